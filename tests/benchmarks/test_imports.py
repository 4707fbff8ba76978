"""The benchmarks' shape, read from the source: every module lives in a family folder that lists
it, no import cycle among benchmarks/ modules (imports inside functions and under TYPE_CHECKING
count), and none imports a pytest conftest."""

from __future__ import annotations

import ast
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
FAMILIES = ("anchors", "serving", "fleet", "micro", "traces")


def _name(path: Path) -> str:
    """`serving/report.py` -> `serving.report`; a package's `__init__.py` -> its folder's name."""
    parts = path.relative_to(BENCHMARKS).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(BENCHMARKS.rglob("*.py")) if "results" not in p.parts}


def imports_of(path: Path) -> set[str]:
    """Every `benchmarks.X` (or `tests.X...`) module `path` imports, anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith(("benchmarks.", "tests."))}


GRAPH = {name: {m.removeprefix("benchmarks.") for m in imports_of(path)
                if m.startswith("benchmarks.")}
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
    assert "serving.shared" in GRAPH["serving.report"]
    assert "serving.runs" in GRAPH["serving.bench_serving"]
    assert "fleet.runs" in GRAPH["fleet.bench_fleet"]
    assert "anchors.driver" in GRAPH["anchors.bench_multiturn"]
    assert "common" in GRAPH["micro.bench_gpu"]


def test_every_module_is_in_a_family_folder_that_lists_it() -> None:
    """Only `common.py` sits at the root; each family's `__init__` lists its files, one a line."""
    assert {p.name for p in BENCHMARKS.glob("*.py")} == {"common.py"}
    assert {p.parent.name for p in BENCHMARKS.glob("*/*.py")} == set(FAMILIES)
    for family in FAMILIES:
        init = ast.parse((BENCHMARKS / family / "__init__.py").read_text())
        doc = ast.get_docstring(init, clean=False) or ""
        listed = set(re.findall(r"^ +(\w+\.py) ", doc, re.MULTILINE))
        files = {p.name for p in (BENCHMARKS / family).glob("*.py")} - {"__init__.py"}
        assert files and listed == files, f"benchmarks/{family}/__init__.py lists {sorted(listed)}"


def test_every_import_names_a_module_that_exists() -> None:
    stale = sorted((name, target) for name, targets in GRAPH.items() for target in targets
                   if target not in MODULES)
    assert stale == []


def test_no_import_cycle_among_the_benchmarks() -> None:
    assert _cycle() is None, " -> ".join(_cycle() or [])


def test_no_benchmark_imports_a_conftest() -> None:
    """Process helpers come from harness/, which the tests' conftest.py files import too."""
    offenders = sorted(name for name, path in MODULES.items()
                       if any(m.rsplit(".", 1)[-1] == "conftest" for m in imports_of(path)))
    assert offenders == []
