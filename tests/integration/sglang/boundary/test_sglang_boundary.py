"""The typed SGLang boundary (issue 37): every SGLang name kvtier's integration code touches is
listed in `sglang_api.SURFACE`, and nothing listed is stale.

A plain `ast` scan of `kvtier/integration/` (no SGLang needed) finds the touches:

- every `from sglang... import name` / `import sglang...`, and the attributes, methods and
  keyword arguments used on what they import (`HookType.AROUND`, `RadixKey(cache_salt=)`);
- every name read with `getattr(x, "name")` / `hasattr(x, "name")` (also through a loop over
  literal names): whose object it is cannot be told, so the name must be listed under some
  owner (or in `NOT_SGLANG`, with whose it is);
- the members of the `Protocol` views in `sglang_views.py` (mypy holds every read on a typed
  SGLang object to its view), under the SGLang classes `view_of` names;
- in kvtier's subclasses of SGLang classes: the members they inherit (`self.x` they never
  assign, `super().x`) and the public methods they override;
- the plugin's hook targets (`HOOK_TARGETS`).

The canary (test_sglang_api.py, `sglang`-marked) checks that each listed name exists in the
installed SGLang, and that kvtier's own members of those subclasses shadow nothing of SGLang's.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.integration.sglang.boundary import sglang_api

ROOT = Path(__file__).resolve().parents[4]
INTEGRATION = ROOT / "kvtier" / "integration"
VIEWS_FILE = INTEGRATION / "sglang" / "boundary" / "sglang_views.py"

# Functions whose `getattr`/`hasattr` calls read no SGLang object at run time (not scanned):
# (file name, function).
NOT_SCANNED = {
    ("attach.py", "attach_config"),  # kvtier's own Config, by a computed name
    # the canary's own checks (they resolve what SURFACE lists)
    ("sglang_canary.py", "_resolve"), ("sglang_canary.py", "_has"),
    ("sglang_canary.py", "_exists"), ("sglang_canary.py", "check"),
}


@dataclass
class Subclass:
    """A kvtier class deriving from an SGLang class."""

    name: str  # module path:class name
    base: str  # the SGLang class, dotted
    own: set[str] = field(default_factory=set)  # what the class itself defines or assigns
    overrides: set[str] = field(default_factory=set)  # its public methods
    kvtier_bases: list[str] = field(default_factory=list)  # bases that are no SGLang names
    self_reads: list[tuple[str, str]] = field(default_factory=list)  # (name, where) touched


@dataclass
class Scan:
    owned: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    named: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    computed: list[str] = field(default_factory=list)
    subclasses: list[Subclass] = field(default_factory=list)

    def touch(self, owner: str, name: str, where: str) -> None:
        self.owned[(owner, name)].append(where)


def _literal_names(node: ast.expr) -> list[str] | None:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    return None


def _is_getattr(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2


def _loop_names(tree: ast.AST) -> dict[int, list[str]]:
    """`getattr(x, v)` calls (by id) whose `v` loops over literal names, with the names."""
    out: dict[int, list[str]] = {}
    for node in ast.walk(tree):
        loops: list[tuple[ast.expr, ast.expr, list[ast.AST]]] = []
        if isinstance(node, ast.For):
            loops.append((node.target, node.iter, list(node.body)))
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            loops += [(g.target, g.iter, [node]) for g in node.generators]
        for target, it, body in loops:
            names = _literal_names(it)
            if names is None or not isinstance(target, ast.Name):
                continue
            for part in body:
                for call in ast.walk(part):
                    if _is_getattr(call) and isinstance(call.args[1], ast.Name) \
                            and call.args[1].id == target.id:  # type: ignore[attr-defined]
                        out[id(call)] = names
    return out


def _chain(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None unless a plain chain of names."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _functions(tree: ast.AST) -> dict[int, str]:
    """Every node's enclosing function name, by node id."""
    out: dict[int, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                out[id(node)] = fn.name  # inner functions are walked later and win
    return out


def scan_source(text: str, where: str, result: Scan | None = None) -> Scan:
    """The SGLang touches of one module's source (`where` names it in reports)."""
    out = Scan() if result is None else result
    tree = ast.parse(text)
    short = Path(where).name
    bound: dict[str, str] = {}  # local name -> the SGLang module or object it is bound to
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
            for alias in node.names:
                out.touch(node.module or "", alias.name, f"{short}:{node.lineno}")
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "sglang":
                    continue
                parent, _, leaf = alias.name.rpartition(".")
                if parent:
                    out.touch(parent, leaf, f"{short}:{node.lineno}")
                modules.add(alias.name)
                bound[alias.asname or "sglang"] = alias.name if alias.asname else "sglang"

    def resolve(parts: list[str], lineno: int) -> str | None:
        """The dotted SGLang path of a chain rooted at an SGLang import, touching each step."""
        if parts[0] not in bound:
            return None
        path = bound[parts[0]]
        for attr in parts[1:]:
            nxt = f"{path}.{attr}"
            if not any(m == nxt or m.startswith(nxt + ".") for m in modules):
                out.touch(path, attr, f"{short}:{lineno}")
            path = nxt
        return path

    loops = _loop_names(tree)
    functions = _functions(tree)
    for node in ast.walk(tree):
        line = f"{short}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            parts = _chain(node)
            if parts is not None and len(parts) == 2:  # longer chains pass through here too
                resolve(parts, node.lineno)
        if isinstance(node, ast.Call):
            parts = _chain(node.func)
            callee = resolve(parts, node.lineno) if parts is not None else None
            if callee is not None:
                for kw in node.keywords:
                    if kw.arg is not None:
                        out.touch(callee, kw.arg, line)
        if _is_getattr(node) and (short, functions.get(id(node), "")) not in NOT_SCANNED:
            assert isinstance(node, ast.Call)
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.named[arg.value].append(line)
            elif id(node) in loops:
                for name in loops[id(node)]:
                    out.named[name].append(line)
            else:
                out.computed.append(f"{line} ({ast.unparse(node)})")
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            _scan_subclass(cls, bound, where, out)
    return out


def _scan_subclass(cls: ast.ClassDef, bound: dict[str, str], where: str, out: Scan) -> None:
    bases = [bound[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in bound]
    if not bases:
        return
    base = bases[0]
    sub = Subclass(f"{where}:{cls.name}", base, kvtier_bases=[
        b.id for b in cls.bases if isinstance(b, ast.Name) and b.id not in bound])
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sub.own.add(item.name)
            if not item.name.startswith("_"):
                sub.overrides.add(item.name)
        elif isinstance(item, ast.Assign):
            sub.own |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and item.value is not None \
                and isinstance(item.target, ast.Name):
            sub.own.add(item.target.id)  # an annotation alone declares an inherited member
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                    and t.value.id == "self":
                sub.own.add(t.attr)
    short = Path(where).name
    for node in ast.walk(cls):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id == "self" and node.attr not in sub.own:
            out.touch(base, node.attr, f"{short}:{node.lineno}")
            sub.self_reads.append((node.attr, f"{short}:{node.lineno}"))
        elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
                and value.func.id == "super":
            out.touch(base, node.attr, f"{short}:{node.lineno}")
    for name in sub.overrides:
        out.touch(base, name, f"{short}:{cls.name}.{name} (override)")
    out.subclasses.append(sub)


def protocol_members(text: str) -> dict[str, set[str]]:
    """The members each `Protocol` class of a module declares itself."""
    out: dict[str, set[str]] = {}
    for cls in ast.walk(ast.parse(text)):
        if not isinstance(cls, ast.ClassDef) or not any(
                isinstance(b, ast.Name) and b.id == "Protocol" for b in cls.bases):
            continue
        members = out.setdefault(cls.name, set())
        for item in cls.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                members.add(item.target.id)
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                members.add(item.name)
    return out


def scan_integration() -> Scan:
    """The touches of every module under kvtier/integration/, views and hook targets too."""
    out = Scan()
    for path in sorted(INTEGRATION.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        scan_source(path.read_text(), rel, out)
    for view, members in protocol_members(VIEWS_FILE.read_text()).items():
        for owner in sglang_api.VIEWS.get(view, ()):
            for name in members:
                out.touch(owner, name, f"sglang_views.py:{view}")
    for target in sglang_api.HOOK_TARGETS.values():
        owner, _, name = target.rpartition(".")
        out.touch(owner, name, "sglang_api.HOOK_TARGETS")
    _drop_kvtier_base_members(out)
    return out


def _drop_kvtier_base_members(out: Scan) -> None:
    """A kvtier subclass that also derives from kvtier's own subclasses of the same SGLang class
    (mixins: `KVTierRadixCache(StoragePrefetchHooks, BlendHooks, UnifiedRadixCache)`) reads
    their members as its own, not SGLang's."""
    own = {sub.name.rpartition(":")[2]: sub for sub in out.subclasses}
    for sub in out.subclasses:
        inherited = {name for b in sub.kvtier_bases if b in own and own[b].base == sub.base
                     for name in own[b].own}
        for name, where in sub.self_reads:
            if name in inherited and where in out.owned.get((sub.base, name), []):
                out.owned[(sub.base, name)].remove(where)
                if not out.owned[(sub.base, name)]:
                    del out.owned[(sub.base, name)]


def missing_from_list(found: Scan) -> list[str]:
    """Touches `SURFACE` (or `NOT_SGLANG`) does not list, as report lines."""
    listed = {name for names in sglang_api.SURFACE.values() for name in names}
    out = []
    for (owner, name), where in sorted(found.owned.items()):
        if name in sglang_api.SURFACE.get(owner, ()):
            continue
        if all(w.endswith("(override)") for w in where) and (
                name in sglang_api.CALLED_BY_SGLANG or name in sglang_api.NOT_SGLANG):
            continue  # a method SGLang calls though the base lacks it, or kvtier's own
        views = [w.split(":", 1)[1] for w in where if w.startswith("sglang_views.py:")]
        if views and all(w.startswith("sglang_views.py:") for w in where) and all(
                any(name in sglang_api.SURFACE.get(o, ()) for o in sglang_api.VIEWS[view])
                for view in views):
            continue  # a view member: listed under one of the classes the view describes
        out.append(f"{owner}.{name} (at {', '.join(sorted(set(where)))})")
    for name, where in sorted(found.named.items()):
        if name not in listed and name not in sglang_api.NOT_SGLANG:
            out.append(f"getattr/hasattr name {name!r} (at {', '.join(where)})")
    out += [f"getattr/hasattr with a computed name at {w}: read literal names, or list the "
            f"function in NOT_SCANNED if it reads no SGLang object" for w in found.computed]
    return out


def test_every_sglang_touch_in_the_integration_code_is_listed() -> None:
    missing = missing_from_list(scan_integration())
    assert not missing, ("SGLang touches not listed in sglang_api.SURFACE (list each under "
                         "its SGLang owner; the canary then checks it exists):\n"
                         + "\n".join(missing))


def test_the_list_holds_nothing_the_code_no_longer_touches() -> None:
    found = scan_integration()
    stale = [f"{owner}.{name}" for owner, names in sglang_api.SURFACE.items() for name in names
             if (owner, name) not in found.owned and name not in found.named]
    assert not stale, "listed in sglang_api.SURFACE but touched nowhere:\n" + "\n".join(stale)
    unused = sorted(set(sglang_api.NOT_SGLANG) - set(found.named)
                    - {n for (_, n) in found.owned})
    assert not unused, f"NOT_SGLANG names nothing reads: {unused}"
    overrides = {name for sub in found.subclasses for name in sub.overrides}
    assert set(sglang_api.CALLED_BY_SGLANG) <= overrides, "CALLED_BY_SGLANG names no method"


def test_every_view_names_the_sglang_classes_it_describes() -> None:
    views = protocol_members(VIEWS_FILE.read_text())
    assert set(views) == set(sglang_api.VIEWS), "a Protocol view without @view_of (or back)"
    for view, owners in sglang_api.VIEWS.items():
        assert owners and all(o in sglang_api.SURFACE for o in owners), (view, owners)


def test_the_scan_sees_each_kind_of_touch() -> None:
    found = scan_integration()
    base = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
    for owner, name in [
            ("sglang.srt.managers.schedule_batch", "FINISH_ABORT"),  # a function-level import
            ("sglang.srt.plugins.hook_registry.HookType", "AROUND"),  # an imported class's member
            ("sglang.srt.mem_cache.radix_cache.RadixKey", "cache_salt"),  # a keyword argument
            (base, "protected_size"), (base, "token_to_kv_pool_allocator"),  # inherited
            (base, "match_prefix"),  # overridden
            ("sglang.srt.mem_cache.pool_host.base.HostKVCache", "get_dummy_flat_data_page"),
            ("sglang.srt.managers.schedule_batch.Req", "origin_input_ids"),  # a view member
            ("sglang.srt.managers.scheduler.Scheduler", "on_idle")]:  # a hook target
        assert (owner, name) in found.owned, (owner, name)
    for name in ("multimodal_inputs", "is_eagle", "kv_lora_rank",  # getattr / hasattr
                 "is_hybrid_swa", "revision"):  # through a loop over literal names
        assert name in found.named, name
    assert {s.base for s in found.subclasses} == {
        base, "sglang.srt.mem_cache.hicache_storage.HiCacheStorage"}


def test_a_new_sglang_touch_fails_until_it_is_listed() -> None:
    source = '''
from sglang.srt.managers.schedule_batch import Req, FINISH_ABORT
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

def f(req, name):
    Req.some_new_classmethod()
    return getattr(req, "some_new_field", None), getattr(req, name)

class Tree(UnifiedRadixCache):
    def match_prefix(self, params):
        self.mine = 1
        return self.mine, self.some_inherited_helper(), super().some_base_method()
'''
    found = scan_source(source, "kvtier/integration/sglang/new_module.py")
    missing = "\n".join(missing_from_list(found))
    for touch in ("schedule_batch.Req.some_new_classmethod", "'some_new_field'",
                  "UnifiedRadixCache.some_inherited_helper",
                  "UnifiedRadixCache.some_base_method", "computed name at new_module.py:7"):
        assert touch in missing, touch
    for listed in ("FINISH_ABORT", "UnifiedRadixCache.match_prefix ", ".mine"):
        assert listed not in missing, listed
