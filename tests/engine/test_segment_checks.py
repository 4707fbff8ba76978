"""Segment records compared with the segment computed alone again: every tier's chunks and tails
are compared, what differs leaves the tier that holds it (counted like prefix records), what
matches stays, and a load then reads only records that match."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.backends.base import StorageBackend
from kvtier.blend.segments import Segment
from kvtier.config import Config
from kvtier.engine.segments import SegmentStore
from kvtier.keys import ChunkKey, KeyBuilder, KeyChain
from kvtier.memory import KVLayout, lease
from kvtier.storage import StorageManager

LAYOUT = KVLayout.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
DOC = list(range(100, 143))  # 43 tokens: two chunks of 16 and a tail of 8 are stored
STORED = 40


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[tuple[SegmentStore, StorageManager]]:
    cfg = Config(chunk_size=16, max_local_cpu_size=0.016, save_tails=True,
                 local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05)
    storage = StorageManager(cfg, LAYOUT)
    keys = KeyBuilder(model="m", fingerprint=LAYOUT.fingerprint(16), chunk_size=16, tails=True,
                      page_size=4)
    yield SegmentStore(storage, keys, LAYOUT), storage
    storage.close()


def _kv(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(len(DOC)), generator=torch.Generator().manual_seed(seed))


def _records(chain: KeyChain) -> list[ChunkKey]:
    return [*chain, chain.tails(len(chain))[0]]


def _put(storage: StorageManager, tier: StorageBackend, keys: list[ChunkKey],
         kv: torch.Tensor) -> None:
    """Write `kv`'s rows for `keys` into `tier` alone, as a writer (or a forger) would."""
    objs = []
    with lease(objs):
        for key in keys:
            obj = storage.allocator.allocate(LAYOUT, key.num_tokens)
            assert obj is not None
            obj.tensor.copy_(kv[:, :, key.start:key.end])
            objs.append(obj)
        tier.batch_put(keys, objs)
    assert tier.batch_contains(keys[:1]) == 1


def _held(tier: StorageBackend, keys: list[ChunkKey]) -> list[bool]:
    return [bool(tier.batch_contains([k])) for k in keys]


def _counts(storage: StorageManager) -> dict[str, int]:
    return {k: v for k, v in storage.counters.snapshot().items() if "verify" in k}


def test_honest_records_match_in_every_tier_and_stay(
        tiers: tuple[SegmentStore, StorageManager]) -> None:
    store, storage = tiers
    chain = store.chain(DOC, Segment(0, len(DOC)))
    kv = _kv(0)
    assert store.save(chain, kv) == STORED
    assert storage.flush(30)
    verdicts = store.verify(chain, kv.clone())
    assert [(v.tier, v.chunk, v.matched) for v in verdicts] == [
        (tier, i, True) for tier in ("cpu", "disk") for i in range(3)]
    assert all(v.error == 0 for v in verdicts)
    assert _counts(storage) == {"cpu.verify_checked": 3, "disk.verify_checked": 3}
    for tier in storage.tiers:
        assert _held(tier, _records(chain)) == [True] * 3


def test_a_forged_record_in_one_tier_leaves_that_tier_only(
        tiers: tuple[SegmentStore, StorageManager]) -> None:
    store, storage = tiers
    chain = store.chain(DOC, Segment(0, len(DOC)))
    honest, forged = _kv(0), _kv(1)
    cpu, disk = storage.hot, storage.lower_tiers[0]
    _put(storage, cpu, _records(chain), honest)
    _put(storage, disk, _records(chain), forged)  # every value forged, as in issue 67
    verdicts = store.verify(chain, honest)
    assert [(v.tier, v.chunk, v.matched) for v in verdicts] == [
        ("cpu", 0, True), ("cpu", 1, True), ("cpu", 2, True),
        ("disk", 0, False), ("disk", 2, False)]  # its first chunk, then its tail
    assert verdicts[3].layer == 0 and verdicts[3].error > 0.5
    assert _held(cpu, _records(chain)) == [True] * 3
    assert _held(disk, _records(chain)) == [False] * 3
    counts = _counts(storage)
    assert counts["disk.verify_mismatch"] == 2 and "cpu.verify_mismatch" not in counts


def test_a_record_forged_past_the_first_layer_or_in_its_tail_is_found(
        tiers: tuple[SegmentStore, StorageManager]) -> None:
    store, storage = tiers
    chain = store.chain(DOC, Segment(0, len(DOC)))
    honest = _kv(0)
    forged = honest.clone()
    forged[:, 2, 16:] += 0.05 * torch.randn_like(forged[:, 2, 16:])  # last layer, chunk 1 on
    cpu = storage.hot
    _put(storage, cpu, _records(chain), forged)
    verdicts = store.verify(chain, honest)
    assert [(v.chunk, v.layer) for v in verdicts] == [(0, None), (1, 2), (2, 2)]
    # Chunk 1 left with what follows it; chunk 0 is honest and stays: a load reads 16 tokens.
    assert _held(cpu, _records(chain)) == [True, False, False]
    assert store.lookup(chain) == 16
    out = torch.full(LAYOUT.shape(len(DOC)), float("nan"))
    assert store.load(chain, out) == 16 and torch.equal(out[:, :, :16], honest[:, :, :16])


def test_a_shorter_forged_tail_cannot_stand_in_for_the_longest(
        tiers: tuple[SegmentStore, StorageManager]) -> None:
    store, storage = tiers
    chain = store.chain(DOC, Segment(0, len(DOC)))
    honest = _kv(0)
    tails = chain.tails(len(chain))  # longest first: tokens 32-40, then 32-36
    _put(storage, storage.hot, _records(chain), honest)
    _put(storage, storage.hot, [tails[1]], _kv(2))
    verdicts = store.verify(chain, honest)
    assert [(v.chunk, v.key.end, v.matched) for v in verdicts] == [
        (0, 16, True), (1, 32, True), (2, 40, True), (2, 36, False)]
    assert _held(storage.hot, [tails[0], tails[1]]) == [True, False]


def test_a_tier_that_holds_nothing_of_the_segment_is_not_compared(
        tiers: tuple[SegmentStore, StorageManager]) -> None:
    store, storage = tiers
    chain = store.chain(DOC, Segment(0, len(DOC)))
    assert store.verify(chain, _kv(0)) == []
    assert _counts(storage) == {}
