"""Verification by the tail blames by source (issue 67, hostile review: one forged plain Redis
record made a server purge its honest CPU and disk records, which had supplied the prefix).

A chunk computed over a loaded prefix that no tier's record matches accuses either the records
or the prefix. The prefix is suspect only when a tier that supplied it holds one of the
differing records; otherwise the differing records alone are quarantined. Real CPU, disk and
Redis tiers; the CPU tier's copy of a Redis record counts as Redis's."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.redis import RedisProcess
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine

SLOTS, CHUNK, LAYERS = 256, 16, 4
TOKENS = 4 * CHUNK + 5  # 4 full chunks; a tail verification computes chunk 3
TAIL = 3 * CHUNK


class _Pool(SGLangMHAConnector):
    """An MHA pool whose layer buffers the test keeps (to change the KV under the engine)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.k, self.v = ([torch.randn(SLOTS, 2, 8, generator=gen) for _ in range(LAYERS)]
                          for _ in range(2))
        super().__init__(self.k, self.v)


def _config(tmp_path: Path, **kw: Any) -> Config:
    return Config(chunk_size=CHUNK, max_local_cpu_size=0.016, save_tails=False,
                  local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05, **kw)


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 30_000, (TOKENS,), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def slots() -> torch.Tensor:
    return torch.randperm(SLOTS, generator=torch.Generator().manual_seed(4))[:2 * TOKENS]


def _tiers(engine: CacheEngine, tokens: torch.Tensor) -> dict[str, int]:
    """How many leading chunks of `tokens` each tier holds."""
    keys = engine.key_chain(tokens)
    return {t.name: t.batch_contains(keys) for t in engine._storage.tiers}


@pytest.fixture
def served(tmp_path: Path, redis_server: RedisProcess, tokens: torch.Tensor,
           slots: torch.Tensor) -> Iterator[CacheEngine]:
    """A server with CPU, disk and Redis tiers; every tier holds the prompt's honest chunks 0-2
    (this server computed them), and Redis alone holds chunk 3: a forged plain record, which
    an earlier request loaded, so the CPU tier holds a copy of it."""
    namespace = f"blame-{uuid.uuid4().hex[:8]}"
    rows = slots[:TOKENS]
    engine = CacheEngine(_config(tmp_path, remote_url=redis_server.url, key_namespace=namespace),
                         model_name="m", layout=_Pool().layout, connector=_Pool())
    forger_pool = _Pool()
    for buf in forger_pool.v:
        buf[rows[TAIL:TAIL + CHUNK]] = torch.randn(CHUNK, 2, 8)
    forger = CacheEngine(Config(chunk_size=CHUNK, max_local_cpu_size=0.016, save_tails=False,
                                remote_url=redis_server.url, key_namespace=namespace),
                         model_name="m", layout=forger_pool.layout, connector=forger_pool)
    try:
        assert engine.store(tokens[:TAIL], rows[:TAIL]) == TAIL and engine.flush(30)
        assert forger.store(tokens, rows) == 4 * CHUNK and forger.flush(30)
        assert _tiers(engine, tokens) == {"cpu": 3, "disk": 3, "redis": 4}
        # An earlier request loaded the whole hit into other rows: chunk 3 came from Redis.
        assert engine.retrieve(tokens, slots[TOKENS:]) == 4 * CHUNK
        assert _tiers(engine, tokens)["cpu"] == 4
    finally:
        forger.close()
    yield engine
    engine.close()


def test_a_forged_tail_record_loses_its_records_and_the_prefix_stays(
        served: CacheEngine, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """Before: no tier's record of chunk 3 matched, so the 9 honest records of chunks 0-2 left
    every tier. Now the prefix came from the CPU tier's own records, and that tier holds no
    record of chunk 3 of its own: the forged record (and the CPU tier's copy of it) goes, the
    rest stays, and the store writes the fresh chunk where it was."""
    rows = slots[:TOKENS]
    result = served.verify(tokens, rows, start=TAIL, loaded=True)
    assert result.purged == 0 and result.stored == CHUNK
    assert {(v.tier, v.source, v.chunk, v.matched) for v in result.verdicts} == {
        ("cpu", "redis", 3, False), ("redis", "redis", 3, False)}
    assert served.flush(30)
    assert _tiers(served, tokens) == {"cpu": 4, "disk": 4, "redis": 4}
    again = served.verify(tokens, rows)  # in full: every record is this model's KV now
    assert len(again.verdicts) == 12 and not again.mismatches


def test_a_forged_tail_that_only_redis_holds_is_blamed_on_redis(
        served: CacheEngine, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """The reported case with the CPU tier's copy of the forged chunk gone (evicted)."""
    assert served.tiers.remove([served.key_chain(tokens)[3]], "cpu") == {"cpu": 1}
    result = served.verify(tokens, slots[:TOKENS], start=TAIL, loaded=True)
    assert [(v.tier, v.chunk, v.matched) for v in result.verdicts] == [("redis", 3, False)]
    assert result.purged == 0 and served.flush(30)
    assert _tiers(served, tokens) == {"cpu": 4, "disk": 4, "redis": 4}


def test_a_changed_model_whose_prefix_came_from_disk_is_still_purged(
        tmp_path: Path, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """After a restart the CPU tier holds copies of the disk's records. A model changed under
    the same identity differs from the disk's record of chunk 3, and the disk supplied the
    prefix: the prefix is suspect, and every chunk leaves every tier."""
    pool = _Pool()
    engine = CacheEngine(_config(tmp_path), model_name="m", layout=pool.layout, connector=pool)
    try:
        rows = slots[:TOKENS]
        assert engine.store(tokens, rows) == 4 * CHUNK and engine.flush(30)
        assert engine.tiers.remove(engine.key_chain(tokens), "cpu") == {"cpu": 4}  # a restart
        assert engine.retrieve(tokens, slots[TOKENS:]) == 4 * CHUNK  # read from disk
        for layer in range(2, LAYERS):
            pool.v[layer][rows[TAIL:]] *= 1.05
        result = engine.verify(tokens, rows, start=TAIL, loaded=True)
        assert {(v.tier, v.source, v.matched) for v in result.verdicts} == {
            ("cpu", "disk", False), ("disk", "disk", False)}
        assert result.stored == 0 and result.purged == 2 * 3  # chunk 3 went in the quarantine
        assert engine.flush(30) and _tiers(engine, tokens) == {"cpu": 0, "disk": 0}
    finally:
        engine.close()
