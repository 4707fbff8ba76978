"""Fixtures the storage tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.memory import lease
from kvtier.storage import StorageManager
from tests.helpers import SMALL_MHA, make_keys, make_obj

CHUNK = 16


@pytest.fixture
def disk_with_chunks(tmp_path: Path) -> Iterator[Callable[[int], StorageManager]]:
    """`make(hot)`: a CPU tier (default policy, adaptive) over a disk tier holding 32 chunks of
    `make_keys(32 * CHUNK)`, the first `hot` of them also in the CPU tier, and the disk's
    speeds measured (as its probe and first read time them)."""
    made: list[StorageManager] = []

    def make(hot: int) -> StorageManager:
        cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.008,
                     local_disk=str(tmp_path / "d"), max_local_disk_size=0.1)
        assert cfg.prefetch_policy == "adaptive"  # the default
        sm = StorageManager(cfg, SMALL_MHA)
        made.append(sm)
        keys = make_keys(32 * CHUNK)
        objs = [make_obj(sm.allocator, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
        with lease(objs):
            sm.put(keys, objs)
        assert sm.flush()
        sm.hot.remove(keys[hot:])
        (disk,) = sm.lower_tiers
        disk.batch_contains(keys[:1])
        for obj in disk.batch_get(keys[:1]):
            obj.release()
        assert disk.speed.known
        return sm

    yield make
    for sm in made:
        sm.close()
