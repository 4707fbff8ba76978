"""`admission_policy: adaptive` (`AdaptiveSecondHit`): stores everything while few offered
prefixes start with a chunk the tier evicted lately, refuses first-seen prefixes (as
`second_hit`) once more than a quarter do, and stores everything again below 0.15; through the
storage manager, a prompt that keeps coming back between one-off prompts is hit where
`always` lets the one-offs push it out every time."""

from __future__ import annotations

from kvtier.config import Config
from kvtier.memory import MemoryAllocator
from kvtier.storage import StorageManager
from kvtier.storage.admission import (
    REFUSE_ABOVE,
    STORE_BELOW,
    AdaptiveSecondHit,
    make_admission,
)
from tests.helpers import SMALL_MHA, make_keys
from tests.storage.test_admission import _store

CHUNK = 16


def test_the_switch_follows_the_share_of_offers_that_return_after_an_eviction() -> None:
    policy = AdaptiveSecondHit(chunks=256)  # an average over the last 64 offers
    fresh = iter(make_keys(CHUNK, seed=s) for s in range(10_000))
    evicted = [make_keys(CHUNK, seed=-s - 1) for s in range(200)]
    for keys in evicted:  # stored while the arena had room, then evicted
        assert policy.admit(keys, lambda: True) == 1
        policy.evicted(keys)
    # First-seen prompts that never come back: stored, full arena or not.
    assert all(policy.admit(next(fresh), lambda: False) == 1 for _ in range(100))
    assert not policy.refusing
    # Every other offer now starts with a chunk the tier evicted: the share passes 0.25.
    n = 0
    while not policy.refusing:
        policy.admit(evicted[n], lambda: True)
        n += 1
        assert policy.admit(next(fresh), lambda: True) == 1  # room: stored anyway
    assert n > 20 and policy.stats()["admission_refusing"] == 1
    offered = next(fresh)
    assert policy.admit(offered, lambda: False) == 0  # first seen, and it would evict
    assert policy.admit(offered, lambda: False) == 1  # seen: stored
    assert policy.admit(evicted[n], lambda: False) == 1  # offered before: known
    assert policy.stats()["admission_refused_chunks"] == 1
    # No more returns: the share decays below 0.15 and everything is stored again.
    refused = 0
    while policy.refusing:
        refused += policy.admit(next(fresh), lambda: False) == 0
    assert refused > 10
    assert policy.admit(next(fresh), lambda: False) == 1
    assert STORE_BELOW < REFUSE_ABOVE


def _manager(policy: str, chunks: int) -> StorageManager:
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=chunks * 4096 / 1e9,
                 eviction_policy="lru", admission_policy=policy)
    return StorageManager(cfg, SMALL_MHA, MemoryAllocator(chunks * 4096, pin=False))


def test_a_returning_prompt_is_hit_between_one_offs_once_the_tier_refuses_them() -> None:
    managers = {p: _manager(p, 8) for p in ("always", "adaptive")}
    try:
        hits = {}
        for name, sm in managers.items():
            prompt = make_keys(4 * CHUNK, seed=1)
            hits[name] = 0
            for i in range(120):  # the prompt, then two one-offs: 8 new chunks between uses
                hits[name] += sm.contains(prompt, hot_only=True)
                _store(sm, prompt)
                for j in (0, 1):
                    _store(sm, make_keys(4 * CHUNK, seed=1000 + 2 * i + j))
        assert hits["always"] == 0  # LRU: the one-offs evict it before each use
        assert hits["adaptive"] > 40 * 4  # a third of its uses, at least
        assert managers["adaptive"].stats()["admission_refused_chunks"] > 0
    finally:
        for sm in managers.values():
            sm.close()


def test_adaptive_is_a_config_choice() -> None:
    assert Config(admission_policy="adaptive").admission_policy == "adaptive"
    assert isinstance(make_admission("adaptive", 1 << 20, 4096), AdaptiveSecondHit)
