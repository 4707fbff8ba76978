"""The engine wing's one fill/put/read path (kvtier/engine/chunk_io.py): where a run stops,
what is counted, who owns the objects."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from kvtier.config import Config
from kvtier.engine import chunk_io
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryObj, lease
from kvtier.storage import StorageManager
from tests.helpers import make_keys

# 16 tokens of this layout are 512 KiB: a 2 MB arena holds a few chunks, never ten.
BIG = KVLayout.mha(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.float32)


@pytest.fixture
def storage() -> Iterator[StorageManager]:
    manager = StorageManager(Config(chunk_size=16, max_local_cpu_size=0.002), BIG)
    manager.counters.declare("store_no_memory")  # as CacheEngine does
    yield manager
    manager.close()


def _kv(keys: Sequence[ChunkKey]) -> torch.Tensor:
    return torch.randn(BIG.shape(keys[-1].end), generator=torch.Generator().manual_seed(1))


def test_allocation_stops_at_the_first_chunk_without_memory_counted_once(
        storage: StorageManager) -> None:
    objs = chunk_io.allocate(storage, BIG, [16] * 10)
    with lease(objs):
        assert 0 < len(objs) < 10
        assert storage.stats()["store_no_memory"] == 1
        assert not chunk_io.allocate(storage, BIG, [16], no_memory=None)
        assert storage.stats()["store_no_memory"] == 1  # not counted when told not to
    assert storage.allocator.used_bytes == 0


def test_a_copy_that_raises_releases_what_was_filled(storage: StorageManager) -> None:
    def copy(i: int, obj: MemoryObj) -> None:
        if i == 2:
            raise RuntimeError("the source went away")
        obj.tensor.zero_()

    with pytest.raises(RuntimeError, match="went away"):
        chunk_io.fill(storage, BIG, [16] * 3, copy)
    assert storage.allocator.used_bytes == 0


def test_store_puts_the_leading_run_and_read_returns_it(storage: StorageManager) -> None:
    keys = make_keys(160, layout=BIG)  # ten chunks: more than the arena holds
    kv = _kv(keys)

    def fill(i: int, obj: MemoryObj) -> None:
        obj.tensor.copy_(kv[:, :, keys[i].start:keys[i].end])

    put = chunk_io.store(storage, BIG, keys, fill)
    assert 0 < len(put) < len(keys) and list(put) == keys[:len(put)]
    out = torch.zeros_like(kv)
    seen: list[Sequence[ChunkKey]] = []

    def read(hit: Sequence[ChunkKey], objs: list[MemoryObj]) -> None:
        seen.append(hit)
        for key, obj in zip(hit, objs, strict=True):
            out[:, :, key.start:key.end].copy_(obj.tensor)

    assert chunk_io.read(storage, keys, read) == len(put)
    end = put[-1].end
    assert torch.equal(out[:, :, :end], kv[:, :, :end])
    assert chunk_io.read(storage, keys[len(put):], read) == 0
    assert len(seen) == 1  # a miss calls no copy
