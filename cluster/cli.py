"""`moectl topology ...` commands."""

from __future__ import annotations

import typer

topology_app = typer.Typer(
    no_args_is_help=True,
    help="Cluster topology: show, discover, probe bandwidth, parse nccl-tests.",
)


def register(app: typer.Typer) -> None:
    app.add_typer(topology_app, name="topology")
