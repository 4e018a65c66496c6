"""Thin wrapper: `python bench/cache.py [options]` = `moectl bench cache [options]`.

The logic lives in `cache_service.bench` so the command also works from an installed package.
"""

from __future__ import annotations

import sys

from deploy.cli import main

if __name__ == "__main__":
    main(["bench", "cache", *sys.argv[1:]])
