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
    """Whether Triton is installed and this torch can use it: a CUDA (or ROCm) build, or the
    interpreter (looked up once: it is asked on every kernel call). A CPU build of torch never
    launches a kernel outside the interpreter, so its processes (every Ray worker of a CPU
    replica) do not import Triton: ~50 MB of resident memory and ~0.1 s each."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    return bool(torch.version.cuda or torch.version.hip) or triton_interpreted()


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
