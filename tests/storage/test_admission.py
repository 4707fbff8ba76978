"""Admission policies (`admission_policy`): `always` stores every chunk offered; `second_hit`
refuses a first-seen prefix only when storing it would evict, so a cache with room behaves as
before, and a prefix offered again (or evicted and offered again) is stored whole."""

from __future__ import annotations

import pytest

from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, MemoryObj, lease
from kvtier.storage import StorageManager
from kvtier.storage.admission import AdmitAll, SecondHit, make_admission
from tests.helpers import SMALL_MHA, make_keys

CHUNK = 16
ARENA_CHUNKS = 8  # SMALL_MHA chunks of 16 tokens take one 4096-byte arena unit each


def _manager(policy: str) -> StorageManager:
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=ARENA_CHUNKS * 4096 / 1e9,
                 admission_policy=policy)
    return StorageManager(cfg, SMALL_MHA, MemoryAllocator(ARENA_CHUNKS * 4096, pin=False))


def _store(sm: StorageManager, keys: list[ChunkKey]) -> int:
    """What the engine does: admission, then allocation and put; the chunks stored."""
    todo = keys[sm.contains(keys, hot_only=True):]
    todo = todo[:sm.admit(todo)]
    objs: list[MemoryObj] = []
    with lease(objs):
        for key in todo:
            obj = sm.allocator.allocate(SMALL_MHA, key.num_tokens)
            if obj is None:
                break
            objs.append(obj)
        sm.put(todo[:len(objs)], objs)
    return len(objs)


def test_second_hit_stores_everything_while_the_arena_has_room() -> None:
    sm = _manager("second_hit")
    try:
        a, b = make_keys(3 * CHUNK, seed=1), make_keys(4 * CHUNK, seed=2)
        assert _store(sm, a) == 3 and _store(sm, b) == 4  # 7 of 8 chunks: no eviction
        assert sm.contains(a) == 3 and sm.contains(b) == 4
        assert sm.stats()["admission_refused_chunks"] == 0
    finally:
        sm.close()


def test_second_hit_keeps_a_reused_prefix_from_one_off_prompts() -> None:
    sm, lru = _manager("second_hit"), _manager("always")
    try:
        shared = make_keys(6 * CHUNK, seed=3)
        for m in (sm, lru):
            assert _store(m, shared) == 6
            for seed in range(10, 14):  # one-off prompts of 4 chunks: each would evict
                _store(m, make_keys(4 * CHUNK, seed=seed))
        assert sm.contains(shared) == 6  # refused every one-off, kept the prefix
        assert lru.contains(shared) < 6  # LRU let the one-offs push it out
        assert sm.stats()["admission_refused_chunks"] == 16
        # A one-off offered a second time is known: stored, evicting what it must.
        again = make_keys(4 * CHUNK, seed=10)
        assert _store(sm, again) == 4 and sm.contains(again) == 4
    finally:
        sm.close()
        lru.close()


def test_an_evicted_prefix_offered_again_is_stored() -> None:
    sm = _manager("second_hit")
    try:
        first = make_keys(8 * CHUNK, seed=4)
        assert _store(sm, first) == 8  # the arena had room
        second = make_keys(5 * CHUNK, seed=5)
        assert _store(sm, second) == 0  # first seen, and the arena is full
        assert _store(sm, second) == 5  # seen once: stored, evicting first's tail
        assert 0 < sm.contains(first) < 8
        held = sm.contains(first)
        assert _store(sm, first) == 8 - held  # first's evicted tail is known: stored again
        assert sm.stats()["admission_refused_chunks"] == 5  # second's first offer only
    finally:
        sm.close()


def test_second_hit_forgets_the_least_recently_offered_keys() -> None:
    policy = SecondHit(capacity=4)
    keys = make_keys(6 * CHUNK, seed=6)
    assert policy.admit(keys[:1], lambda: False) == 0  # never seen
    assert policy.admit(keys[:1], lambda: False) == 1  # seen once
    policy.admit(keys[1:6], lambda: True)  # five more keys: keys[0] and keys[1] are forgotten
    assert policy.stats()["admission_ghost_keys"] == 4
    assert policy.admit(keys[:1], lambda: False) == 0
    assert policy.admit(keys[5:], lambda: False) == 1
    assert policy.admit([], lambda: False) == 0


def test_the_policies_come_from_the_config_and_a_bad_name_names_the_key() -> None:
    assert Config().admission_policy == "adaptive"
    assert isinstance(make_admission("always", 1 << 20, 4096), AdmitAll)
    assert isinstance(make_admission("second_hit", 1 << 20, 4096), SecondHit)
    with pytest.raises(ConfigError, match="admission_policy"):
        Config(admission_policy="first_hit")
    with pytest.raises(ConfigError, match="admission_policy"):
        make_admission("nope", 1 << 20, 4096)
