"""The repository layout of DESIGN.md and the CLI root."""

from __future__ import annotations

import importlib
import tomllib

from tests.conftest import REPO

PACKAGES = ["cluster", "placement", "actors", "cache_service", "deploy"]


def test_top_level_packages_are_listed_explicitly():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    for name in PACKAGES:
        assert name in include, f"{name} missing from pyproject's explicit package list"
        importlib.import_module(name)
    for folder in ("helm", "tests", "bench"):
        assert (REPO / folder).is_dir()


def test_every_dependency_is_bounded():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [
        d for ds in project["optional-dependencies"].values() for d in ds
    ]
    for dep in deps:
        assert "<" in dep and ">=" in dep, f"dependency {dep!r} needs a lower and an upper bound"


def test_readme_opens_with_the_two_commands():
    head = (REPO / "README.md").read_text().split("\n## ", 1)[0]
    assert "make run" in head and "make test" in head


def test_root_cli_help_lists_commands(moectl):
    code, out, _ = moectl("--help")
    assert code == 0
    assert "model" in out and "topology" in out


def test_unknown_command_is_a_usage_error(moectl):
    code, _, err = moectl("no-such-command")
    assert code == 2
    assert "no-such-command" in err


def test_a_command_exit_code_reaches_the_shell():
    """typer returns (not raises) a command's Exit code in non-standalone mode: main must keep it."""
    import subprocess
    import sys

    code = (
        "import typer, deploy.cli as c\n"
        "@c.app.command('exit-seven')\n"
        "def _x():\n"
        "    raise typer.Exit(7)\n"
        "c.main(['exit-seven'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
