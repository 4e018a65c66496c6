"""`moectl`, the root command line.

Each package contributes its own commands through a `register(app)` function in its `cli.py`;
those modules import only typer/rich at module level and load heavy libraries (torch, ray, redis)
inside the command that needs them, so `moectl --help` stays fast.
"""

from __future__ import annotations

import sys

import typer

from cluster.errors import MoeError

app = typer.Typer(
    name="moectl",
    help="Plan, run, validate and serve Mixture-of-Experts models too large for one accelerator.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register_all() -> None:
    # Step 1: bottom layers first, so `--help` lists commands in the order a user needs them.
    from cluster import cli as cluster_cli
    from placement import cli as placement_cli

    placement_cli.register(app)
    cluster_cli.register(app)
    for module in _optional_clis():
        module.register(app)


def _optional_clis() -> list:
    """CLI modules of the upper packages; each registers its commands when it exists."""
    import importlib

    found = []
    for name in (
        "actors.validate.cli",
        "cache_service.cli",
        "deploy.serve_cli",
        "deploy.adapt_cli",
        "deploy.render_cli",
        "actors.bench.long_context_cli",
    ):
        try:
            found.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency inside the module: surface it
                raise
    return found


_register_all()


def _user_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [MoeError]
    try:
        from cache_service.errors import CacheError

        types.append(CacheError)
    except ModuleNotFoundError:
        pass
    return tuple(types)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `moectl` console script; always ends with SystemExit(code)."""
    user_errors = _user_error_types()
    try:
        # In non-standalone mode typer returns a command's `typer.Exit` code instead of raising it.
        rc = app(args=argv, standalone_mode=False, prog_name="moectl")
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except typer.TyperException as exc:  # usage errors: unknown option, bad value for a flag
        exc.show(file=sys.stderr)
        sys.exit(exc.exit_code)
    except user_errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2))
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
