"""Write-around (`kvtier.engine.around`): a prefix the CPU tier's admission refuses still
reaches the lower tiers, so a second server reading the same disk (or Redis) finds a turn this
one computed, whatever the write policy; the CPU tier keeps what admission kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine

CHUNK, LAYERS, HEADS, DIM = 16, 2, 2, 8  # a chunk: 16 x 2 x 8 x 4 B x 2 (K, V) x 2 = 4 KiB
TIER_CHUNKS = 16
PROMPT_CHUNKS = 4
SLOTS = PROMPT_CHUNKS * CHUNK


def _pool() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(SLOTS, HEADS, DIM, generator=gen) for _ in range(2 * LAYERS)]


def _engine(tmp_path: Path, policy: str = "second_hit", bufs: list[torch.Tensor] | None = None,
            **cfg: object) -> CacheEngine:
    bufs = _pool() if bufs is None else bufs
    connector = SGLangMHAConnector(bufs[:LAYERS], bufs[LAYERS:])
    cfg = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.05, **cfg}
    config = Config(chunk_size=CHUNK, max_local_cpu_size=TIER_CHUNKS * 4096 / 1e9,
                    save_tails=False, admission_policy=policy, **cfg)  # type: ignore[arg-type]
    return CacheEngine(config, model_name="m", layout=connector.layout, connector=connector)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 30_000, (SLOTS,), generator=torch.Generator().manual_seed(seed))


def _fill_then_refuse(eng: CacheEngine) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Fill the CPU tier with prompts it had room for, then store a first-seen one that would
    evict: `second_hit` refuses it. Returns (the stored prompts, the refused one)."""
    slots = torch.arange(SLOTS)
    kept = [_tokens(seed) for seed in range(TIER_CHUNKS // PROMPT_CHUNKS)]
    for tokens in kept:
        assert eng.store(tokens, slots) == SLOTS
    refused = _tokens(99)
    assert eng.store(refused, slots) == 0  # not stored in the CPU tier
    assert eng.flush(30)
    return kept, refused


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_a_refused_prefix_reaches_the_disk_and_a_second_server(
        tmp_path: Path, write_policy: str) -> None:
    cfg = {"write_policy": write_policy}
    with _engine(tmp_path, **cfg) as eng:
        kept, refused = _fill_then_refuse(eng)
        assert eng.lookup(refused, hot_only=True) == 0
        assert all(eng.lookup(t, hot_only=True) == SLOTS for t in kept)  # admission's point
        stats = eng.stats()
        assert stats["admission_refused_chunks"] == PROMPT_CHUNKS
        assert stats["written_around"] == PROMPT_CHUNKS
        assert stats.get("write_around_no_memory", 0) == 0
        assert eng.lookup(refused) == SLOTS  # on disk
    empty = [torch.zeros_like(b) for b in _pool()]
    with _engine(tmp_path, bufs=empty, **cfg) as second:  # another server on the same disk
        assert second.lookup(refused) == SLOTS
        assert second.retrieve(refused, torch.arange(SLOTS)) == SLOTS
        assert all(torch.equal(a, b) for a, b in zip(empty, _pool()))  # the KV stored


def test_without_a_lower_tier_nothing_is_copied_around(tmp_path: Path) -> None:
    with _engine(tmp_path, local_disk=None) as eng:
        _fill_then_refuse(eng)
        stats = eng.stats()
        assert stats["admission_refused_chunks"] == PROMPT_CHUNKS
        assert stats.get("written_around", 0) == 0
        assert "written_around" in eng._storage.counters.snapshot(declared=True)


def test_always_has_no_write_around_buffer(tmp_path: Path) -> None:
    with _engine(tmp_path, policy="always") as eng:
        assert "written_around" not in eng._storage.counters.snapshot(declared=True)
