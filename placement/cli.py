"""`moectl model ...` and `moectl plan` commands."""

from __future__ import annotations

import typer

model_app = typer.Typer(
    no_args_is_help=True,
    help="Understand a model from its config.json: operators, parameters, memory.",
)


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")
