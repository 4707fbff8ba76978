"""StorageManager over real tiers (CPU + disk): policies, promotion, backpressure, failures."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path

import pytest

from kvtier.backends.cpu import CPUBackend
from kvtier.backends.record import expected_header_len
from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj, lease
from kvtier.storage import StorageManager
from tests.helpers import SMALL_MHA, make_keys, put_random, same_bytes, use_backend

CHUNK = 16


def _config(tmp_path: Path, **kw: object) -> Config:
    args: dict = {"chunk_size": CHUNK, "max_local_cpu_size": 0.008,
                  "local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.1}
    args.update(kw)
    return Config(**args)


@pytest.fixture
def manager(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageManager]:
    kw = getattr(request, "param", {})
    sm = StorageManager(_config(tmp_path, **kw), SMALL_MHA)
    yield sm
    alloc = sm.allocator
    sm.close()
    alloc.check_integrity()
    assert alloc.used_bytes == 0


def _put(sm: StorageManager, keys: Sequence[ChunkKey], seed: int = 0) -> list:
    return put_random(sm.put, sm.allocator, SMALL_MHA, keys, seed)


def _tier(sm: StorageManager, name: str):  # noqa: ANN202
    return next(t for t in sm.tiers if t.name == name)


def test_write_through_then_promote_from_disk(manager: StorageManager) -> None:
    keys = make_keys(64)
    want = _put(manager, keys)
    assert manager.flush()
    disk, cpu = _tier(manager, "disk"), manager.hot
    assert disk.batch_contains(keys) == 4
    cpu.remove(keys[1:])  # chunk 0 in both, the rest on disk only
    assert manager.contains(keys) == 4
    with manager.get(keys) as objs:
        assert [same_bytes(o.tensor, w) for o, w in zip(objs, want)] == [True] * 4
    assert cpu.batch_contains(keys) == 4  # promoted
    assert manager.stats()["disk.hit_chunks"] == 3


@pytest.mark.parametrize("manager", [{"write_policy": "write_back",
                                      "max_local_cpu_size": 24 * 4096 / 1e9}], indirect=True)
def test_write_back_writes_on_eviction_and_close(manager: StorageManager,
                                                 tmp_path: Path) -> None:
    keys = make_keys(16 * 8)
    _put(manager, keys)
    assert manager.flush()
    disk = _tier(manager, "disk")
    assert disk.batch_contains(keys) == 0
    # Pressure: store more than the arena holds so the first prompt is evicted to disk.
    others = make_keys(16 * 40, seed=1)
    for key in others:
        obj = manager.allocator.allocate(SMALL_MHA, key.num_tokens)
        if obj is None:  # write-back holds evicted chunks until written: fail fast, retry
            assert manager.flush()
            obj = manager.allocator.allocate(SMALL_MHA, key.num_tokens)
        assert obj is not None
        with lease([obj]):
            manager.put([key], [obj])
    assert manager.flush()
    assert manager.stats()["cpu_evictions"] > 0
    assert disk.batch_contains(keys) + manager.hot.batch_contains(keys) >= 1
    in_cpu = manager.hot.batch_contains(others[::-1])
    manager.close()
    again = StorageManager(_config(tmp_path, local_cpu=False), SMALL_MHA)
    try:
        assert in_cpu > 0
        assert again.contains(others) == len(others)  # the rest was written at close
    finally:
        again.close()


@pytest.mark.parametrize("manager", [{"write_policy": "write_through_selective",
                                      "selective_write_threshold": 2}], indirect=True)
def test_selective_write_after_threshold_hits(manager: StorageManager) -> None:
    keys = make_keys(32)
    _put(manager, keys)
    disk = _tier(manager, "disk")
    with manager.get(keys):
        pass
    assert manager.flush() and disk.batch_contains(keys) == 0
    with manager.get(keys[:1]):
        pass
    assert manager.flush() and disk.batch_contains(keys) == 1


def test_orphans_are_not_written(manager: StorageManager) -> None:
    keys = make_keys(48)
    _put(manager, keys[1:])  # chunk 0 never stored: 1 and 2 would be unreachable on disk
    assert manager.flush()
    assert _tier(manager, "disk").batch_contains(keys[1:]) == 0
    assert manager.stats()["disk.write_orphans"] == 2


def test_tier_failure_is_a_miss(manager: StorageManager, tmp_path: Path) -> None:
    keys = make_keys(32)
    _put(manager, keys)
    assert manager.flush()
    manager.hot.remove(keys)
    shutil.rmtree(tmp_path / "disk")  # behind the tier's back
    with manager.get(keys) as objs:
        assert objs == []
    assert manager.contains(keys) in (0, 2)  # index may still list them; get is what counts


@pytest.mark.parametrize("manager", [{"prefetch_policy": "wait_complete"}], indirect=True)
def test_prefetch_loads_into_cpu(manager: StorageManager) -> None:
    keys = make_keys(48)
    _put(manager, keys)
    assert manager.flush()
    manager.hot.remove(keys)
    assert manager.prefetch(keys).result() == 3
    assert manager.hot.batch_contains(keys) == 3


class _GatedCPU(CPUBackend):
    """A real tier whose writes wait for a gate: a stand-in for a slow disk or network."""

    name = "gated"
    gate = threading.Event()

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        self.gate.wait(30)
        return super().batch_put(keys, objs)


def test_full_write_queue_drops_and_never_blocks(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(monkeypatch, "disk", f"{__name__}:_GatedCPU")
    _GatedCPU.gate.clear()
    sm = StorageManager(_config(tmp_path, write_queue_chunks=2), SMALL_MHA)
    try:
        keys = make_keys(16 * 40)
        for i in range(0, 40, 4):
            _put(sm, keys[i:i + 4])  # returns at once although the lower tier is stuck
        assert sm.stats()["gated.write_dropped"] >= 30
        assert sm.hot.batch_contains(keys) > 0
    finally:
        _GatedCPU.gate.set()
        sm.close()
    assert sm.allocator.used_bytes == 0


class _SlowGetCPU(CPUBackend):
    """A real tier whose reads wait for a gate: a stand-in for a slow network tier."""

    name = "slow"
    gate = threading.Event()

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        self.gate.wait(30)
        return super().batch_get(keys)


def test_prefetch_timeout_policy_returns_after_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    use_backend(monkeypatch, "disk", f"{__name__}:_SlowGetCPU")
    _SlowGetCPU.gate.clear()
    cfg = _config(tmp_path, prefetch_policy="timeout", prefetch_timeout_base_ms=1.0,
                  prefetch_timeout_per_token_ms=0.0)
    sm = StorageManager(cfg, SMALL_MHA)
    try:
        keys = make_keys(48)
        _put(sm, keys)
        assert sm.flush()
        sm.hot.remove(keys)
        future = sm.prefetch(keys)  # the lower tier is stuck: returns once the budget is spent
        assert not future.done() and sm.stats()["prefetch_timeouts"] == 1
        _SlowGetCPU.gate.set()
        assert future.result(timeout=30) == 3
        assert sm.hot.batch_contains(keys) == 3
    finally:
        _SlowGetCPU.gate.set()
        sm.close()


def test_stream_closed_early_releases_the_chunks_read_ahead(manager: StorageManager) -> None:
    keys = make_keys(16 * 8)
    want = _put(manager, keys)
    assert manager.flush()
    manager.hot.remove(keys)
    assert manager.allocator.used_bytes == 0
    with closing(manager.stream(keys)) as chunks:
        first = next(chunks)  # the disk tier reads the next chunks ahead meanwhile
        assert same_bytes(first.tensor, want[0])
        first.release()
    # Only the promoted first chunk is left: whatever was read ahead went back to the arena.
    assert manager.hot.batch_contains(keys) == 1
    manager.hot.remove(keys)
    assert manager.allocator.used_bytes == 0


def test_stream_yields_every_chunk_in_order_from_disk(manager: StorageManager) -> None:
    keys = make_keys(16 * 8)
    want = _put(manager, keys)
    assert manager.flush()
    manager.hot.remove(keys)
    with closing(manager.stream(keys)) as chunks:
        got = [(same_bytes(o.tensor, w), o.release())[0] for o, w in zip(chunks, want)]
    assert got == [True] * 8


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_without_a_cpu_tier_stores_are_not_kept_and_loads_are_staged(tmp_path: Path,
                                                                       policy: str) -> None:
    sm = StorageManager(_config(tmp_path, local_cpu=False, write_policy=policy), SMALL_MHA)
    try:
        assert [t.name for t in sm.tiers] == ["staging", "disk"]
        assert sm.policy.name == "write_through"  # nothing kept in memory to write back
        keys = make_keys(48)
        want = _put(sm, keys)
        assert sm.flush()
        assert sm.allocator.used_bytes == 0  # what was stored is not kept in memory
        prefetch = sm.start_prefetch(keys)
        assert prefetch.result(timeout=5) == 3  # read in the background, staged ...
        prefetch.cancel()  # (the request is admitted)
        with sm.get(keys, hot_only=True) as objs:
            assert [same_bytes(o.tensor, w) for o, w in zip(objs, want)] == [True] * 3
        sm.unstage(keys)  # ... until delivered
        assert sm.hot.batch_contains(keys) == 0 and sm.allocator.used_bytes == 0
    finally:
        sm.close()


class _Unbuildable(CPUBackend):
    def __init__(self, ctx: object) -> None:
        raise ConfigError("remote_url: cannot reach the tier")


def test_a_tier_that_cannot_be_built_leaves_nothing_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(monkeypatch, "redis", f"{__name__}:_Unbuildable")
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError, match="remote_url"):
        StorageManager(_config(tmp_path, remote_url="redis://127.0.0.1:1"), SMALL_MHA)
    assert {t.name for t in threading.enumerate()} - before == set()  # no writer left behind


def test_cpu_hits_keep_their_prefix_on_the_disk(tmp_path: Path) -> None:
    # The CPU tier serves prefix A again and again while other prompts pass through a disk of
    # 8 records: the disk must learn of those uses (`StorageBackend.touch`), keep A, and take
    # A's extension (before, it evicted A as its least recently used and refused the
    # extension as an orphan).
    record = expected_header_len(make_keys(CHUNK)[0]) + SMALL_MHA.nbytes(CHUNK)
    sm = StorageManager(_config(tmp_path, max_local_disk_size=8.5 * record / 1e9), SMALL_MHA)
    try:
        disk = _tier(sm, "disk")
        ext = make_keys(3 * CHUNK, seed=1)
        prefix = ext[:2]
        _put(sm, prefix)
        assert sm.flush()
        for i in range(12):
            with sm.get(prefix) as got:
                assert len(got) == 2
            _put(sm, make_keys(2 * CHUNK, seed=100 + i))
            assert sm.flush()
            assert disk.batch_contains(prefix) == 2, f"round {i}: the reused prefix was evicted"
        assert sm.stats()["cpu.hit_chunks"] == 24 and sm.stats()["disk.hit_chunks"] == 0
        _put(sm, ext[2:])
        assert sm.flush()
        assert disk.batch_contains(ext) == 3
        assert sm.stats()["disk.write_orphans"] == 0
        assert sm.stats()["disk.evictions"] > 0
    finally:
        sm.close()
