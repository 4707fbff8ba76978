"""A share of each tier per tenant through the engine (`tenant_max_fraction`, issue 71): a
noisy tenant storing three times the CPU tier (or the disk tier), one prompt at a time and each
written down, leaves a quiet tenant's prompt whole in that tier under a share of 0.5, and
pushes it out without one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.backends.record import expected_header_len
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine

CHUNK, LAYERS, HEADS, DIM = 16, 2, 2, 8  # a chunk: 16 x 2 x 8 x 4 B x 2 (K, V) x 2 = 4 KiB
TIER_CHUNKS = 64
PROMPT_CHUNKS = 8
SLOTS = PROMPT_CHUNKS * CHUNK


def _engine(tmp_path: Path, fraction: float, disk_bytes: int = 50_000_000) -> CacheEngine:
    gen = torch.Generator().manual_seed(0)
    bufs = [torch.randn(SLOTS, HEADS, DIM, generator=gen) for _ in range(2 * LAYERS)]
    connector = SGLangMHAConnector(bufs[:LAYERS], bufs[LAYERS:])
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=TIER_CHUNKS * 4096 / 1e9,
                 save_tails=False, local_disk=str(tmp_path / "disk"),
                 max_local_disk_size=disk_bytes / 1e9, tenant_max_fraction=fraction)
    return CacheEngine(cfg, model_name="m", layout=connector.layout, connector=connector)


def _tokens(seed: int, chunks: int) -> torch.Tensor:
    return torch.randint(0, 30_000, (chunks * CHUNK,),
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_noisy_tenant_leaves_a_quiet_tenants_prompt_in_the_cpu_tier(
        tmp_path: Path, fraction: float) -> None:
    slots = torch.arange(SLOTS)
    quiet = _tokens(1, 4)
    noisy = [_tokens(100 + i, PROMPT_CHUNKS) for i in range(3 * TIER_CHUNKS // PROMPT_CHUNKS)]
    with _engine(tmp_path, fraction) as eng:
        assert eng.store(quiet, slots[:len(quiet)], salt="b") == len(quiet)
        assert eng.flush(30)
        for tokens in noisy:  # 3x the CPU tier, each prompt written down before the next
            assert eng.store(tokens, slots, salt="a") == len(tokens)
            assert eng.flush(30)
        assert eng.lookup(noisy[-1], hot_only=True, salt="a") == len(noisy[-1])
        held = eng.lookup(quiet, hot_only=True, salt="b")
        cpu = eng.stats()
        if fraction < 1:
            assert held == len(quiet), "tenant b lost its prompt to a tenant over its share"
            assert cpu["cpu.share_evictions"] > 0
        else:  # without a share the noisy tenant pushes the quiet one out (issue 71)
            assert held == 0
        # Either way the quiet prompt is whole on disk, and only for its own tenant.
        assert eng.lookup(quiet, salt="b") == len(quiet)
        assert eng.lookup(quiet, salt="a") == 0



DISK_CHUNKS = 32


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_noisy_tenant_leaves_a_quiet_tenants_prompt_on_disk(
        tmp_path: Path, fraction: float) -> None:
    """The same through the disk tier (LRU): A writes 3x its cap after B's prompt."""
    slots = torch.arange(SLOTS)
    quiet = _tokens(1, 4)
    noisy = [_tokens(100 + i, PROMPT_CHUNKS) for i in range(3 * DISK_CHUNKS // PROMPT_CHUNKS)]
    with _engine(tmp_path, 1.0) as probe:  # a record's size (salted keys: one length)
        record = expected_header_len(probe.chunk_keys(quiet, salt="b")[0]) + 4096
    with _engine(tmp_path, fraction, disk_bytes=DISK_CHUNKS * record) as eng:
        disk = next(t for t in eng._storage.tiers if t.name == "disk")
        assert eng.store(quiet, slots[:len(quiet)], salt="b") == len(quiet)
        assert eng.flush(30)
        for tokens in noisy:  # 3x the disk tier, each prompt written down before the next
            assert eng.store(tokens, slots, salt="a") == len(tokens)
            assert eng.flush(30)
        assert disk.batch_contains(eng.chunk_keys(noisy[-1], salt="a")) == PROMPT_CHUNKS
        assert disk.stats()["evictions"] >= 2 * DISK_CHUNKS
        held = disk.batch_contains(eng.chunk_keys(quiet, salt="b"))
        assert held == (4 if fraction < 1 else 0)
