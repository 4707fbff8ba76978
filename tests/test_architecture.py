"""The package's shape, read from the source: no import cycle (imports inside functions and under
TYPE_CHECKING count), config is the foundation, integration code goes through the engine, and
the package root holds the data path only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvtier"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "cpu_shims" not in p.parts}


def _resolve(name: str) -> str | None:
    """The kvtier module `name` lands in: itself, or the nearest package or module above it."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every kvtier module `module` imports, anywhere in its body."""
    tree = ast.parse(MODULES[module].read_text())
    is_package = MODULES[module].name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a.b import c` imports the module a.b.c when there is one
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        else:
            continue
        found |= {r for t in targets if t.startswith("kvtier") and (r := _resolve(t))}
    found.discard(module)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def _cycle_from(start: str) -> list[str] | None:
    stack = [(start, [start])]
    seen: set[str] = set()
    while stack:
        node, path = stack.pop()
        for nxt in GRAPH[node]:
            # a package's __init__ re-exporting its own modules is not an arrow back up
            if nxt == start and not start.startswith(node + "."):
                return [*path, nxt]
            if nxt not in seen and not nxt.startswith(start + "."):
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_the_scan_sees_the_imports_it_must():
    assert "kvtier.config.schema" in GRAPH["kvtier.config.load"]
    assert "kvtier.backends.disk.files" in GRAPH["kvtier.backends.disk.backend"]
    assert "kvtier.engine" in GRAPH["kvtier"]  # a function-level import counts


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_cycle(module):
    cycle = _cycle_from(module)
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("kvtier.config")))
def test_config_imports_no_tier_no_keys_no_storage(module):
    below = ("kvtier.backends", "kvtier.storage", "kvtier.keys", "kvtier.engine",
             "kvtier.connectors", "kvtier.integration", "kvtier.memory", "kvtier.cli")
    bad = sorted(m for m in GRAPH[module] if m.startswith(below))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("kvtier.kernels")))
def test_kernels_import_nothing_of_the_data_path(module):
    # The bottom of the house: the copies know tensors and their own checks, and nothing that
    # calls them (the CUDA streams, which copy through a connector's staging, sit beside the
    # connectors: kvtier.connectors.streams).
    above = ("kvtier.connectors", "kvtier.memory", "kvtier.storage", "kvtier.backends",
             "kvtier.engine", "kvtier.integration", "kvtier.blend", "kvtier.keys", "kvtier.cli")
    bad = sorted(m for m in GRAPH[module] if m.startswith(above))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("kvtier.integration")))
def test_integration_goes_through_the_engine(module):
    # Through the engine wing's doors (CacheEngine, its `tiers`, PageStore), never past them.
    # (nor through the engine's attribute: test_nothing_reads_the_engines_storage_manager)
    bad = sorted(m for m in GRAPH[module] if m.startswith("kvtier.storage"))
    assert not bad, f"{module} imports {bad}"


def test_nothing_reads_the_engines_storage_manager():
    """The storage manager is the engine's own (issue 73): no module of kvtier reads
    `.storage` (`CacheEngine.storage`, a deprecated shim: its definition is no read) and
    `._storage` is read on `self` alone; callers use the engine's doors (`stats`, `flush`,
    `tiers`) or build a StorageManager and pass it in."""
    reads = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        lines = sorted(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                       and isinstance(node.ctx, ast.Load) and (
                           node.attr == "storage" and ast.unparse(node.value) != "kvtier"
                           or node.attr == "_storage" and ast.unparse(node.value) != "self"))
        if lines:
            reads[module] = lines
    assert not reads, f"use the engine's doors, not its storage manager: {reads}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("kvtier.blend")))
def test_blend_computes_and_stores_through_the_engine(module):
    # Blending's storage (segments' KV, their verification) is the engine wing's door.
    bad = sorted(m for m in GRAPH[module] if m.startswith(("kvtier.storage", "kvtier.backends")))
    assert not bad, f"{module} imports {bad}"


def test_the_package_root_holds_the_data_path_only():
    root = {p.stem for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert root == {"__init__", "background", "errors", "memory", "metrics", "prometheus"}
    assert {"backends", "cli", "config", "connectors", "engine", "integration", "keys",
            "storage"} <= folders


@pytest.mark.parametrize("folder", ["kvtier", "benchmarks", "tests", "harness"])
def test_no_file_over_400_lines(folder):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split by topic: {long}"


def test_the_tiers_are_listed_in_one_place():
    """`kvtier.config.tiers` is the table of tiers; no other module lists them (a module
    naming two built-in tiers is listing them). The demo's arms are workloads, not tiers."""
    names = {"CPU", "DISK", "REDIS"}
    listing = {}
    for module, path in MODULES.items():
        if module == "kvtier.config.tiers" or module.startswith("kvtier.demo"):
            continue
        tree = ast.parse(path.read_text())
        named = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module == "kvtier.config.names" for alias in node.names} & names
        if len(named) > 1:
            listing[module] = sorted(named)
    assert not listing, f"list tiers through kvtier.config.tiers: {listing}"


# The modules outside kvtier/backends/ that may still name one tier, and why.
ONE_TIER = {
    "kvtier.storage.hot": "the CPU tier is the storage manager's hot tier by design",
    "kvtier.storage.tierset": "the tier set keeps the hot (CPU) tier apart from the lower ones",
    "kvtier.cli.bench": "`kvtier bench` measures a scratch Redis by name",
}


def test_one_tier_is_named_only_where_it_lives():
    """A branch on one tier's name belongs in that tier's backend: what a tier checks or shows
    goes through its row in kvtier.config.tiers (`check`, its inventory's `peek`). The demo's
    arms are workloads, not tiers."""
    names = {"CPU", "DISK", "REDIS"}
    naming = {}
    for module, path in MODULES.items():
        if module.startswith(("kvtier.backends", "kvtier.demo")) or module in (
                "kvtier.config.tiers", "kvtier.config.names", *ONE_TIER):
            continue
        tree = ast.parse(path.read_text())
        named = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module == "kvtier.config.names" for alias in node.names} | {
            node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "names"}
        if named & names:
            naming[module] = sorted(named & names)
    assert not naming, f"move these branches into the tier's backend or row: {naming}"


def test_the_sglang_integration_is_a_few_concerns():
    """integration/sglang/ holds one sub-package per concern (launch, rank, blending, admin,
    stop, boundary, hicache) and few modules beside them: at most 12 entries in all."""
    top = PACKAGE / "integration" / "sglang"
    entries = sorted(p.name for p in top.iterdir()
                     if p.suffix == ".py" or (p / "__init__.py").exists())
    assert len(entries) <= 12, f"group them by concern: {entries}"


def test_the_architecture_doc_pictures_every_package():
    """docs/architecture.md's picture of the code names every sub-package of kvtier/ and of
    kvtier/integration/sglang/ (as `name/`): a new folder is drawn when it is made."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    folders = [p for top in (PACKAGE, PACKAGE / "integration" / "sglang")
               for p in top.iterdir() if (p / "__init__.py").exists()]
    missing = sorted(str(p.relative_to(ROOT)) for p in folders if f"{p.name}/" not in text)
    assert not missing, f"draw them in docs/architecture.md: {missing}"
