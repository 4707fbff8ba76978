"""`CacheEngine.tiers` (`kvtier.engine.tiers.TierControl`) beyond attach and detach (those:
tests/storage/test_tier_attach.py): chunks removed from one tier or from all, with a count per
tier and the watchers told; a tenant's chunks in the CPU tier. And the deprecated
`CacheEngine.storage` (issue 73): still the engine's storage manager for one release, with a
`DeprecationWarning` naming what to use instead."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.memory import KVLayout
from kvtier.storage import StorageManager
from tests.storage.test_watch import Seen

CHUNK, LAYERS, HEADS, DIM = 16, 2, 2, 8
CHUNKS = 4
SLOTS = CHUNKS * CHUNK


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[CacheEngine]:
    gen = torch.Generator().manual_seed(0)
    bufs = [torch.randn(SLOTS, HEADS, DIM, generator=gen) for _ in range(2 * LAYERS)]
    connector = SGLangMHAConnector(bufs[:LAYERS], bufs[LAYERS:])
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.01, save_tails=False,
                 local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05)
    with CacheEngine(cfg, model_name="m", layout=connector.layout, connector=connector) as eng:
        yield eng


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 30_000, (SLOTS,), generator=torch.Generator().manual_seed(seed))


def _stored(engine: CacheEngine, seed: int = 1, salt: str = "") -> torch.Tensor:
    tokens = _tokens(seed)
    assert engine.store(tokens, torch.arange(SLOTS), salt=salt) == SLOTS
    assert engine.flush(30)
    return tokens


def test_a_chunk_removed_from_one_tier_stays_in_the_others(engine: CacheEngine) -> None:
    seen = Seen()
    engine.tiers.watch(seen)
    tokens = _stored(engine)
    keys = engine.chunk_keys(tokens)
    assert engine.tiers.remove(keys, "cpu") == {"cpu": CHUNKS}
    assert engine.lookup(tokens, hot_only=True) == 0
    assert engine.lookup(tokens) == SLOTS  # the disk tier still has it
    names = {k.key for k in keys}
    assert not names & seen.held["cpu"] and names <= seen.held["disk"]
    assert engine.tiers.remove(keys, "cpu") == {"cpu": 0}  # gone already


def test_a_chunk_removed_from_every_tier_is_counted_per_tier(engine: CacheEngine) -> None:
    seen = Seen()
    engine.tiers.watch(seen)
    tokens, other = _stored(engine), _stored(engine, seed=2)
    counts = engine.tiers.remove(engine.chunk_keys(tokens))
    assert list(counts.items()) == [("cpu", CHUNKS), ("disk", CHUNKS)]  # fastest first
    assert engine.lookup(tokens) == 0
    assert engine.lookup(other, hot_only=True) == SLOTS  # another prompt's chunks stay
    assert not {k.key for k in engine.chunk_keys(tokens)} & (seen.held["cpu"] |
                                                             seen.held["disk"])


def test_an_unknown_tier_is_refused_naming_the_attached_ones(engine: CacheEngine) -> None:
    tokens = _stored(engine)
    with pytest.raises(ValueError, match=r"'redis' is not attached.*\['cpu', 'disk'\]"):
        engine.tiers.remove(engine.chunk_keys(tokens), "redis")
    assert engine.lookup(tokens, hot_only=True) == SLOTS  # nothing removed


def test_a_tenants_chunks_are_its_own(engine: CacheEngine) -> None:
    a, b = _stored(engine, 1, salt="tenant-a"), _stored(engine, 2, salt="tenant-b")
    _stored(engine, 3)  # unsalted: no tenant's
    assert set(engine.tiers.tenant_chunks("tenant-a")) == set(engine.chunk_keys(a, "tenant-a"))
    assert set(engine.tiers.tenant_chunks("tenant-b")) == set(engine.chunk_keys(b, "tenant-b"))
    assert engine.tiers.tenant_chunks("tenant-c") == []


def test_the_storage_attribute_still_works_and_warns(tmp_path: Path) -> None:
    """`CacheEngine.storage`, deprecated for one release: the manager passed in, and a
    warning that names the doors to use, pointing at the caller's line."""
    layout = KVLayout.mha(LAYERS, HEADS, DIM, torch.float32)
    bufs = [torch.zeros(SLOTS, HEADS, DIM) for _ in range(2 * LAYERS)]
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.01)
    manager = StorageManager(cfg, layout)
    try:
        engine = CacheEngine(cfg, model_name="m", layout=layout, storage=manager,
                             connector=SGLangMHAConnector(bufs[:LAYERS], bufs[LAYERS:]))
        with pytest.warns(DeprecationWarning, match=r"engine\.stats\(\).*engine\.tiers") as got:
            assert engine.storage is manager
        assert got[0].filename == __file__
        engine.close()
    finally:
        manager.close()
