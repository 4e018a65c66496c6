"""Thin wrapper: `python bench/serving.py [options]` = `moectl bench serving [options]`.

The logic lives in `deploy.bench.serving` so the command also works from an installed package.
"""

from __future__ import annotations

import sys

from deploy.cli import main

if __name__ == "__main__":
    main(["bench", "serving", *sys.argv[1:]])
