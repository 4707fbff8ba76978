"""The prefetch policies as classes: a new one is one class and one name, and decides by itself
how much of a hit loads, whether a tail does, and when its caller goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import lease
from kvtier.storage import StorageManager
from kvtier.storage.guard import GuardedTier
from kvtier.storage.prefetch import policy
from kvtier.storage.prefetch.handle import Prefetch
from kvtier.storage.prefetch.planner import LoadPlanner
from tests.helpers import SMALL_MHA, make_keys, make_obj

CHUNK = 16


class _FirstHalf(policy.PrefetchPolicy):
    """Loads the first half of a hit and no tail; its caller never waits."""

    name = "timeout"  # the config offers the names it knows: this one stands in for one

    def budget_s(self, section: object, tokens: int, recompute_s: float) -> float:
        return 60.0

    def plan(self, planner: LoadPlanner, prefetch: Prefetch, hot_chunks: int) -> int:
        return max(hot_chunks, len(prefetch.keys) // 2)

    def tail_worth(self, planner: LoadPlanner, prefetch: Prefetch, n: int, tier: GuardedTier,
                   tail: ChunkKey) -> bool:
        return False

    def admit(self, prefetch: Prefetch, now: float) -> bool:
        return True

    def went_on(self, prefetch: Prefetch, waited_s: float) -> bool:
        return False


def test_a_new_policy_is_one_class_under_one_name(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(policy.POLICIES, "timeout", _FirstHalf())
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.008, local_disk=str(tmp_path / "d"),
                 max_local_disk_size=0.1, prefetch_policy="timeout")
    sm = StorageManager(cfg, SMALL_MHA)
    try:
        keys = make_keys(32 * CHUNK)
        objs = [make_obj(sm.allocator, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
        with lease(objs):
            sm.put(keys, objs)
        assert sm.flush()
        sm.hot.remove(keys)
        prefetch = sm.prefetch(keys)  # admitted at once: no wait for the budget's 60 s
        assert prefetch.ready()
        assert prefetch.result(timeout=30) == 16  # the plan: half, not the whole hit
        assert sm.hot.batch_contains(keys) == 16
        assert sm.stats().get("prefetch_timeouts", 0) == 0
    finally:
        sm.close()


@pytest.mark.parametrize("name, tokens, budget_s", [
    ("adaptive", 1000, 2.5),  # what the load could save: the recompute time
    ("best_effort", 1000, 0.0),
    ("timeout", 1000, 0.001 * 7 + 0.002 * 1000),
    ("wait_complete", 1000, 9.0),
])
def test_each_policy_s_budget(name: str, tokens: int, budget_s: float) -> None:
    cfg = Config(prefetch_timeout_base_ms=7.0, prefetch_timeout_per_token_ms=2.0,
                 prefetch_wait_complete_max_ms=9000.0)
    got = policy.prefetch_policy(name).budget_s(cfg.prefetch, tokens, recompute_s=2.5)
    assert got == pytest.approx(budget_s)


@pytest.mark.parametrize("name, counts", [("adaptive", True), ("timeout", True),
                                          ("best_effort", False), ("wait_complete", False)])
def test_going_on_early_counts_as_a_timeout_where_the_policy_says(name: str, counts: bool,
                                                                  ) -> None:
    prefetch = Prefetch(make_keys(2 * CHUNK), policy.prefetch_policy(name), budget_s=0.0)
    assert prefetch.wait() is False and prefetch.timed_out is counts
    assert policy.prefetch_policy(name).name == name
