"""Thin wrapper: `python bench/pd_disagg.py [options]` = `moectl bench pd [options]`.

The logic lives in `deploy.bench.pd` so the command also works from an installed package.
"""

from __future__ import annotations

import sys

from deploy.cli import main

if __name__ == "__main__":
    main(["bench", "pd", *sys.argv[1:]])
