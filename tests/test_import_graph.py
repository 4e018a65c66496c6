"""The import graph of the product has no cycles: every import counts, the ones inside functions
(lazy) and under `if TYPE_CHECKING:` included, since each still ties the two modules together.

The graph is grimp's (the library under import-linter, whose contracts in pyproject.toml keep
the layers and keep runtime packages off benchmark code). Cycles are found as the strongly
connected components of the module graph (Tarjan's algorithm)."""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("actors", "deploy", "placement", "cluster", "cache_service")


def strongly_connected(adj: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module (a module importing itself is not a cycle here)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(adj):
        if root in index:
            continue
        # Iterative Tarjan: (node, iterator over its successors).
        work = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(adj.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_strongly_connected_finds_a_cycle_and_ignores_a_chain():
    adj = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(adj) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(*PACKAGES, include_external_packages=False)


def test_the_import_graph_has_no_cycles(graph):
    adj = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = strongly_connected(adj)
    lines = []
    for component in cycles:
        members = set(component)
        for a in component:
            for b in sorted(adj[a] & members):
                at = [d["line_number"] for d in graph.get_import_details(importer=a, imported=b)]
                lines.append(f"  {a} -> {b} (line {', '.join(map(str, at))})")
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(lines)


def test_lazy_and_type_checking_imports_are_in_the_graph(graph):
    """The rule covers them: the graph must see an import made inside a function and one under
    TYPE_CHECKING (known examples in the tree)."""
    lazy = graph.get_import_details(
        importer="deploy.model_server", imported="actors.engine.factory"
    )
    assert lazy, "a function-level import is missing from the graph"
    typed = graph.get_import_details(importer="actors.kv.offload", imported="actors.kv.tier_io")
    assert typed, "a TYPE_CHECKING import is missing from the graph"


BENCHMARKS = ("actors.bench", "deploy.bench", "placement.bench", "cache_service.bench")
"""Benchmark code: imported by bench/ scripts and `moectl bench` only."""
BENCH_ENTRY_POINTS = {"deploy.serve_cli", "cache_service.cli"}
"""The `moectl bench ...` commands (actors.bench.long_context_cli registers itself)."""


def _is_bench(module: str) -> bool:
    return any(module == b or module.startswith(b + ".") for b in BENCHMARKS)


def test_no_runtime_module_imports_benchmark_code(graph):
    offenders = sorted(
        f"{m} -> {b}"
        for m in graph.modules
        if not _is_bench(m) and m not in BENCH_ENTRY_POINTS
        for b in graph.find_modules_directly_imported_by(m)
        if _is_bench(b)
    )
    assert not offenders, "runtime modules importing benchmark code:\n" + "\n".join(offenders)


def test_the_benchmark_rule_sees_a_benchmark_import(graph):
    """The rule would catch one: the entry points do import benchmark code."""
    assert any(_is_bench(b) for b in graph.find_modules_directly_imported_by("deploy.serve_cli"))
