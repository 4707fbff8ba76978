"""The benchmarks' shape, read from the source: no import cycle among benchmarks/ modules
(imports inside functions and under TYPE_CHECKING count), and none imports a pytest conftest."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MODULES = {p.stem: p for p in BENCHMARKS.glob("*.py")}


def imports_of(path: Path) -> set[str]:
    """Every `benchmarks.X` (or `tests.X...`) module `path` imports, anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith(("benchmarks.", "tests."))}


GRAPH = {name: {m.split(".")[1] for m in imports_of(path) if m.startswith("benchmarks.")}
         for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(GRAPH.get(node, ())):
            if state.get(nxt) == 1:
                return [*path, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(GRAPH):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_scan_sees_the_imports_it_must() -> None:
    assert "serving_types" in GRAPH["serving_report"]
    assert "serving_bench" in GRAPH["bench_serving"]
    assert "fleet_bench" in GRAPH["bench_fleet"]


def test_no_import_cycle_among_the_benchmarks() -> None:
    assert _cycle() is None, " -> ".join(_cycle() or [])


def test_no_benchmark_imports_a_conftest() -> None:
    """Process helpers come from harness/, which the tests' conftest.py files import too."""
    offenders = sorted(name for name, path in MODULES.items()
                       if any(m.rsplit(".", 1)[-1] == "conftest" for m in imports_of(path)))
    assert offenders == []
