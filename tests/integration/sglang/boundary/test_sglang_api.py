"""The SGLang canary: every SGLang internal kvtier relies on is still where kvtier reaches for
it in the installed SGLang (kvtier.integration.sglang.boundary.sglang_canary). An upgrade
that moves one fails here, naming it and what kvtier uses it for."""

from __future__ import annotations

import pytest

from kvtier.integration.sglang.boundary import sglang_api, sglang_canary

pytestmark = pytest.mark.sglang


def test_every_sglang_internal_kvtier_reaches_is_there() -> None:
    failed = sglang_canary.check_all()
    assert not failed, "SGLang moved what kvtier relies on:\n" + "\n".join(failed)
    assert len(sglang_canary.REACH_INS) >= 15


@pytest.mark.parametrize("item", sglang_canary.REACH_INS, ids=lambda r: r.name)
def test_each_reach_in_checks_something_that_exists(item: sglang_canary.ReachIn) -> None:
    item.check()  # one id per item: the failing one is named in the report


def test_the_canary_names_what_moved() -> None:
    moved = sglang_canary.ReachIn(
        "Scheduler.some_hook_sglang_renamed", "a made-up reliance",
        sglang_canary._has(sglang_api.SCHEDULER, "some_hook_sglang_renamed"))
    renamed = sglang_canary.ReachIn(
        "process_batch_result(batch, outcome)", "a made-up signature",
        sglang_canary._params(f"{sglang_api.SCHEDULER}.process_batch_result", "outcome"))
    original = sglang_canary.REACH_INS
    try:
        sglang_canary.REACH_INS = (*original, moved, renamed)
        failed = sglang_canary.check_all()
    finally:
        sglang_canary.REACH_INS = original
    assert len(failed) == 2
    assert failed[0].startswith("Scheduler.some_hook_sglang_renamed (a made-up reliance)")
    assert "some_hook_sglang_renamed" in failed[0] and "outcome" in failed[1]
    for target in sglang_api.HOOK_TARGETS.values():  # the plugin's hook targets resolve
        assert callable(sglang_canary._resolve(target)), target


def test_kvtier_subclasses_shadow_nothing_of_sglang() -> None:
    """kvtier's own members of its subclasses of SGLang classes (helpers, state) are not
    SGLang's: an SGLang upgrade adding `_load` to its tree would otherwise be overridden
    silently. Overrides are listed in SURFACE (and checked to exist above)."""
    from tests.integration.sglang.boundary.test_sglang_boundary import scan_integration

    subclasses = scan_integration().subclasses
    # the HiCache backend, the tree, and its bases for prefetch hooks, the blender's release
    # and the store
    assert len(subclasses) == 5
    for sub in subclasses:
        base = sglang_canary._resolve(sub.base)
        own = sorted(n for n in sub.own - set(sglang_api.SURFACE[sub.base])
                     - set(sglang_api.CALLED_BY_SGLANG) if not n.startswith("__"))
        assert own, sub.name
        shadowed = [n for n in own if sglang_canary._exists(base, n)]
        assert not shadowed, f"{sub.name} shadows {sub.base}'s {shadowed}"
