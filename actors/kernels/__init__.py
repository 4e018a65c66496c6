"""Device kernels of the decode path, each with a pure-torch fallback of the same signature.

`triton_available()` says whether the Triton versions can run here: on CUDA with Triton
installed, or on the CPU under `TRITON_INTERPRET=1` (the CI correctness check).
"""

from __future__ import annotations

import functools
import importlib.util
import os


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed (looked up once: it is asked on every kernel call)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
