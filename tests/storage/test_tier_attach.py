"""Tiers attached and detached while stores and loads run: no error reaches the caller, nothing
is corrupted, an attached tier serves hits at once."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.redis import RedisProcess
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError
from tests.helpers import SMALL_MHA

CHUNK = 16
SLOTS = 2048


def _engine(cfg: Config, seed: int = 0) -> CacheEngine:
    gen = torch.Generator().manual_seed(seed)
    shape = (SLOTS, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim)
    k = [torch.randn(shape, generator=gen).to(SMALL_MHA.dtype) for _ in range(2)]
    v = [torch.randn(shape, generator=gen).to(SMALL_MHA.dtype) for _ in range(2)]
    engine = CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                         connector=SGLangMHAConnector(k, v))
    POOLS[id(engine)] = k + v
    return engine


POOLS: dict[int, list[torch.Tensor]] = {}  # engine -> its pool's layer buffers


def _prompt(seed: int, n: int = 64) -> torch.Tensor:
    return torch.randint(0, 30_000, (n,), generator=torch.Generator().manual_seed(seed))


def _rows(engine: CacheEngine, slots: torch.Tensor) -> list[torch.Tensor]:
    return [b[slots].clone() for b in POOLS[id(engine)]]


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    return Config(chunk_size=CHUNK, max_local_cpu_size=0.01,
                  local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1)


@pytest.fixture
def cpu_only(cfg: Config) -> Iterator[CacheEngine]:
    engine = _engine(dataclasses.replace(cfg, local_disk=None))
    yield engine
    arena = engine._storage.allocator
    engine.close()
    arena.check_integrity()
    assert arena.used_bytes == 0


def test_attached_disk_takes_writes_and_serves_hits(cpu_only: CacheEngine, cfg: Config) -> None:
    ids, slots = _prompt(1), torch.arange(1, 65)
    cpu_only.tiers.attach("disk", cfg)
    assert cpu_only.tiers.names == ["cpu", "disk"]
    want = _rows(cpu_only, slots)
    assert cpu_only.store(ids, slots) == 64 and cpu_only.flush()
    cpu_only.tiers.remove(cpu_only.chunk_keys(ids), "cpu")
    target = torch.arange(500, 564)
    assert cpu_only.retrieve(ids, target) == 64
    assert all(torch.equal(a, b) for a, b in zip(_rows(cpu_only, target), want))
    assert cpu_only.stats()["tier_attached"] == 1


def test_attached_redis_serves_what_another_instance_stored(
        cpu_only: CacheEngine, cfg: Config, redis_server: RedisProcess) -> None:
    remote = dataclasses.replace(cfg, local_disk=None, remote_url=redis_server.url)
    ids = _prompt(2)
    with _engine(remote, seed=0) as writer:
        assert writer.store(ids, torch.arange(1, 65)) == 64 and writer.flush()
    assert cpu_only.lookup(ids) == 0
    cpu_only.tiers.attach("redis", remote)
    assert cpu_only.lookup(ids) == 64  # at once
    assert cpu_only.retrieve(ids, torch.arange(600, 664)) == 64


@pytest.mark.parametrize("drain", [True, False])
def test_detach_under_load_raises_nothing_and_corrupts_nothing(
        cfg: Config, drain: bool) -> None:
    engine = _engine(cfg)
    errors: list[BaseException] = []
    stop = threading.Event()
    prompts = [_prompt(10 + i) for i in range(8)]

    def work(offset: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                ids = prompts[i % len(prompts)]
                slots = torch.arange(1 + offset, 65 + offset)
                engine.store(ids, slots)
                engine.retrieve(ids, torch.arange(1000 + offset, 1064 + offset))
                i += 1
        except BaseException as exc:  # noqa: BLE001 - the test reports any error
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(64 * i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        while engine.stats().get("disk.hit_chunks", 0) + engine._storage.tiers[1].stats()[
                "puts"] < 8:
            stop.wait(0.001)
        engine.tiers.detach("disk", drain=drain)
        assert engine.tiers.names == ["cpu"]
        stop.wait(0.05)  # keep storing and loading on the CPU tier alone for a moment
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == []
    engine.close()
    engine._storage.allocator.check_integrity()
    assert engine.stats()["arena_used_bytes"] == 0
    # Every record the detached tier left on disk is whole: a fresh tier reads them all back.
    with _engine(dataclasses.replace(cfg, local_cpu=True), seed=1) as again:
        disk = again._storage.tiers[1]
        for ids in prompts:
            keys = again.chunk_keys(ids)
            n = disk.batch_contains(keys)
            objs = disk.batch_get(keys[:n])
            assert len(objs) == n
            for obj in objs:
                obj.release()
        assert disk.stats()["corrupt"] == 0


def test_bad_attach_and_detach_are_errors(cpu_only: CacheEngine, cfg: Config) -> None:
    with pytest.raises(ValueError, match="cpu"):
        cpu_only.tiers.attach("cpu")
    with pytest.raises(ConfigError, match="remote_url"):
        cpu_only.tiers.attach("redis")  # the config has no remote_url
    with pytest.raises(ValueError, match="not attached"):
        cpu_only.tiers.detach("disk")
    with pytest.raises(ValueError, match="CPU tier"):
        cpu_only.tiers.detach("cpu")
    cpu_only.tiers.attach("disk", cfg)
    with pytest.raises(ValueError, match="already attached"):
        cpu_only.tiers.attach("disk", cfg)
    assert cpu_only.tiers.names == ["cpu", "disk"]
