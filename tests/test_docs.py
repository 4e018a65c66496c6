"""What the docs promise about the code stays true: every environment switch the runtime reads is
in the switches table of docs/architecture.md, the results and user pages stay pages (not
diaries), and runtime docstrings say what the code does rather than which round it came from."""

from __future__ import annotations

import re

from tests.conftest import REPO

RUNTIME = ("actors", "cache_service", "cluster", "deploy", "placement")
SWITCH = re.compile(r"\bMOE_[A-Z0-9_]+\b")


def _runtime_sources():
    for package in RUNTIME:
        for path in sorted((REPO / package).rglob("*")):
            if path.suffix in (".py", ".c") and "proto" not in path.parts:
                yield path


def _switches_table() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("## Switches")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_every_environment_switch_is_in_the_docs_table():
    table = _switches_table()
    missing = {}
    for path in _runtime_sources():
        for name in SWITCH.findall(path.read_text()):
            if f"`{name}`" not in table:
                missing.setdefault(name, str(path.relative_to(REPO)))
    assert not missing, f"switches read but not in docs/architecture.md's table: {missing}"


def test_the_table_names_no_switch_the_runtime_no_longer_reads():
    read = {name for path in _runtime_sources() for name in SWITCH.findall(path.read_text())}
    listed = set(SWITCH.findall(_switches_table()))
    assert listed <= read, f"listed but read nowhere: {sorted(listed - read)}"


def test_results_and_user_pages_stay_short():
    for name, limit in (("README.md", 320), ("BENCHMARKS.md", 330)):
        lines = (REPO / name).read_text().count("\n")
        assert lines <= limit, f"{name} has {lines} lines (a page, not a diary: <= {limit})"


def test_runtime_docstrings_tell_no_round_narratives():
    pattern = re.compile(r"\b(offload )?round \d+\b|\bbench/notes/", re.IGNORECASE)
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path in _runtime_sources()
        if "bench" not in path.relative_to(REPO).parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"history narratives in runtime code: {found[:10]}"
