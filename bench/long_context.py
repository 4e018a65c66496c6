"""Thin wrapper: `python bench/long_context.py [options]` = `moectl bench long-context [options]`.

The logic lives in `actors.long_context` (sweep.py, cli.py); the command is registered here too
in case the root CLI does not pick up `actors.bench.long_context_cli` yet.
"""

from __future__ import annotations

import sys

from actors.bench.long_context_cli import register
from deploy.cli import app, main


def _registered() -> bool:
    for info in app.registered_groups:
        if info.name == "bench" and info.typer_instance is not None:
            return any(c.name == "long-context" for c in info.typer_instance.registered_commands)
    return False


if __name__ == "__main__":
    if not _registered():
        register(app)
    main(["bench", "long-context", *sys.argv[1:]])
