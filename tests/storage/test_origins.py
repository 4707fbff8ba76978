"""`Origins`: which lower tier the CPU tier's copy of a chunk was read from."""

from __future__ import annotations

from pathlib import Path

from kvtier.config import Config
from kvtier.memory import lease
from kvtier.storage import StorageManager
from kvtier.storage.origins import Origins
from tests.helpers import SMALL_MHA, make_keys, make_obj

CHUNK = 16


def test_a_promoted_copy_is_the_lower_tier_s_until_a_put_replaces_it(tmp_path: Path) -> None:
    sm = StorageManager(Config(chunk_size=CHUNK, max_local_cpu_size=0.008,
                               local_disk=str(tmp_path / "d"), max_local_disk_size=0.1),
                        SMALL_MHA)
    try:
        keys = make_keys(3 * CHUNK)
        objs = [make_obj(sm.allocator, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
        with lease(objs):
            sm.put(keys, objs)
        assert sm.flush()
        assert [sm.origins.of(k, "cpu") for k in keys] == ["cpu"] * 3  # stored here
        sm.hot.remove(keys[1:])
        with sm.get(keys) as got:  # chunks 1 and 2 are read from disk into the CPU tier
            assert len(got) == 3
        assert [sm.origins.of(k, "cpu") for k in keys] == ["cpu", "disk", "disk"]
        again = [make_obj(sm.allocator, SMALL_MHA, keys[2].num_tokens, 2)]
        with lease(again):
            sm.put(keys[2:], again)  # stored here again: the CPU tier's own copy
        assert [sm.origins.of(k, "cpu") for k in keys] == ["cpu", "disk", "cpu"]
    finally:
        sm.close()


def test_the_oldest_origins_are_forgotten_first() -> None:
    origins = Origins(capacity=2)
    keys = make_keys(3 * CHUNK)
    for key in keys:
        origins.promoted(key, "redis")
    assert [origins.of(k, "cpu") for k in keys] == ["cpu", "redis", "redis"]
