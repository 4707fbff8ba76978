"""Segments in real tiers (CPU and disk): put once, found wherever the segment stands, read
back after a restart, tails included; what cannot be stored is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.blend.segments import Segment, find_segments
from kvtier.config import Config
from kvtier.engine.segments import SegmentStore
from kvtier.keys import KeyBuilder
from kvtier.memory import KVLayout
from kvtier.storage import StorageManager

LAYOUT = KVLayout.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
SEP = [0]


def _store(tmp_path: Path) -> tuple[SegmentStore, StorageManager]:
    cfg = Config(chunk_size=16, max_local_cpu_size=0.016, save_tails=True,
                 local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05)
    storage = StorageManager(cfg, LAYOUT)
    keys = KeyBuilder(model="m", fingerprint=LAYOUT.fingerprint(16), chunk_size=16, tails=True,
                      page_size=4)
    return SegmentStore(storage, keys, LAYOUT), storage


def _kv(n: int, seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(n), generator=torch.Generator().manual_seed(seed))


def test_a_segment_is_found_wherever_it_stands_and_after_a_restart(tmp_path: Path) -> None:
    doc = list(range(100, 143))  # 43 tokens: two chunks, a 8-token tail, 3 tokens unkept
    first = doc + SEP + [7, 7]
    second = [5, 6, 7] + SEP + doc + SEP + [9]
    store, storage = _store(tmp_path)
    seg = find_segments(first, SEP)[0]
    kv = _kv(43, 0)
    assert store.lookup(store.chain(first, seg)) == 0
    assert store.save(store.chain(first, seg), kv) == 40
    puts = storage.stats()["chunks_put"]
    assert store.save(store.chain(first, seg), kv) == 40  # held: nothing put again
    assert storage.stats()["chunks_put"] == puts
    assert storage.flush(30)
    storage.close()

    store, storage = _store(tmp_path)  # a restarted server: the disk tier alone holds it
    seg2 = find_segments(second, SEP)[1]
    assert seg2 == Segment(4, 47)
    chain = store.chain(second, seg2)
    assert store.lookup(chain) == 40
    out = torch.full(LAYOUT.shape(43), float("nan"))
    assert store.load(chain, out) == 40
    assert torch.equal(out[:, :, :40], kv[:, :, :40])
    assert out[:, :, 40:].isnan().all()  # never written: the caller computes those tokens
    storage.close()


def test_other_tokens_miss_and_bad_input_is_refused(tmp_path: Path) -> None:
    store, storage = _store(tmp_path)
    toks = list(range(1, 33)) + SEP
    chain = store.chain(toks, Segment(0, 32))
    with pytest.raises(ValueError, match="kv must be"):
        store.save(chain, _kv(31, 1))
    with pytest.raises(ValueError, match="kv must be"):
        store.save(chain, _kv(32, 1).double())
    store.save(chain, _kv(32, 1))
    other = store.chain(list(range(2, 34)) + SEP, Segment(0, 32))
    assert store.lookup(other) == 0
    assert store.load(other, torch.zeros(LAYOUT.shape(32))) == 0
    with pytest.raises(ValueError, match="MHA"):
        SegmentStore(storage, KeyBuilder(model="m", fingerprint="f", chunk_size=16),
                     KVLayout.mla(num_layers=3, kv_dim=24, dtype=torch.float32))
    storage.close()
