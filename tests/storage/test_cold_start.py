"""Never slower from the first request: a guess never costs a wait, a tier slower than recompute
is not asked on the admission path, and a repeated prefix asks no second round trip."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvtier.backends import BACKENDS, BackendContext, StorageBackend
from kvtier.backends.disk import DiskBackend
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage import StorageManager
from kvtier.storage.estimates import PrefillSpeed
from kvtier.storage.existence import Existence
from kvtier.storage.guard import MIN_SAMPLE_BYTES, GuardedTier
from kvtier.storage.planner import LoadPlanner
from kvtier.storage.prefetch import Prefetch, Prefetcher
from tests.helpers import SMALL_MHA, make_keys, make_obj

CHUNK = 16
HANG_BOUND_S = 30.0  # bounds a hang; never expected to pass


class SilentTier(StorageBackend):
    """A remote tier that never answers until the test lets it go (a dead peer's TCP)."""

    name = "redis"
    released = threading.Event()
    asked: list[str] = []  # thread names of the calls

    def __init__(self, ctx: BackendContext):
        self.ctx = ctx

    def _hang(self) -> None:
        SilentTier.asked.append(threading.current_thread().name)
        SilentTier.released.wait(HANG_BOUND_S)

    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        self._hang()
        return 0

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        self._hang()
        return []

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        self._hang()
        return 0

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        return 0

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        SilentTier.released.set()


@pytest.fixture
def silent_redis(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[SilentTier]]:
    SilentTier.released.clear()
    SilentTier.asked.clear()
    monkeypatch.setitem(BACKENDS, "redis", f"{__name__}:SilentTier")
    yield SilentTier
    SilentTier.released.set()


def test_a_fresh_engine_admits_at_once_when_its_tier_never_answers(silent_redis) -> None:
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.016, save_tails=False,
                 remote_url="redis://127.0.0.1:1", blocking_timeout_secs=1.0)
    k = [torch.randn(256, 2, 8).to(torch.bfloat16) for _ in range(2)]
    v = [torch.randn(256, 2, 8).to(torch.bfloat16) for _ in range(2)]
    conn = SGLangMHAConnector(k, v)
    tokens = torch.arange(64, dtype=torch.int64)
    before = [t.clone() for t in k + v]
    with CacheEngine(cfg, model_name="m", layout=conn.layout, connector=conn) as engine:
        engine.observe_prefill(4096, 4096 / 100.0, 4096)  # recompute is slow: loads would pay
        prefetch = engine.start_prefetch(tokens)
        assert prefetch.ready()  # no wait for a plan nor a guessed load: admitted at once
        prefetch.cancel()
        slots = torch.arange(64, dtype=torch.int64)
        assert engine.retrieve(tokens, slots, hot_only=True) == 0  # recomputed, untouched
        assert all(torch.equal(a, b) for a, b in zip(before, k + v))
        silent_redis.released.set()  # the writer's queued put and the probe end; close drains


@pytest.fixture
def measured_disk(disk_with_chunks: Callable[[int], StorageManager]) -> StorageManager:
    """CPU tier over a disk tier holding 32 chunks, none in the CPU tier, both speeds
    measured."""
    return disk_with_chunks(0)


def _spy(tier: GuardedTier) -> list[str]:
    """The thread names of the round trips `tier` makes from now on (a spy on the real tier)."""
    calls: list[str] = []
    inner_contains = tier.inner.batch_contains

    def contains(keys: Sequence[ChunkKey]) -> int:
        calls.append(threading.current_thread().name)
        return inner_contains(keys)

    tier.inner.batch_contains = contains  # type: ignore[method-assign]
    return calls


def test_a_tier_slower_than_the_recompute_is_not_asked_on_admission(measured_disk) -> None:
    sm = measured_disk
    (disk,) = sm.lower_tiers
    for _ in range(32):  # the median of its round trips is now 5 s
        disk.speed.observe_latency(5.0)
    sm.prefill.observe(4096, 4096 / 1000.0, 4096)  # the 512-token prompt: 0.5 s to recompute
    calls = _spy(disk)
    prefetch = sm.start_prefetch(make_keys(32 * CHUNK))
    assert prefetch.ready()  # nothing to wait for: no load can beat the recompute
    assert prefetch.wait_done(HANG_BOUND_S)
    assert prefetch.result() == 0
    assert not [name for name in calls if name.startswith("kvtier-prefetch")]


def test_a_repeated_prefix_makes_one_round_trip(tmp_path: Path) -> None:
    cfg = Config(chunk_size=CHUNK, local_disk=str(tmp_path / "d"), max_local_disk_size=0.1)
    alloc = MemoryAllocator(1 << 20)
    inner = DiskBackend(BackendContext(config=cfg, layout=SMALL_MHA, allocator=alloc))
    disk = GuardedTier(inner, Counters("disk.errors"), RateLimitedLog(logging.getLogger()))
    try:
        keys = make_keys(8 * CHUNK)
        objs = [make_obj(alloc, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
        disk.batch_put(keys[:4], objs[:4])
        calls = _spy(disk)
        planner = LoadPlanner(lambda: [disk], PrefillSpeed(), SMALL_MHA.nbytes,
                              arena_bytes=1 << 30, counters=Counters())
        for _ in range(2):
            planner.plan(Prefetch(keys, "adaptive", budget_s=0.0), 0)
        assert len(calls) == 1  # the second plan knew: 4 held, the 5th not
        assert disk.recall_contains(keys) == 4 and len(calls) == 1
        disk.batch_put(keys[4:6], objs[4:6])  # our own write: the answer is stale
        assert disk.recall_contains(keys) == 6 and len(calls) == 2
        disk.remove(keys[5:6])
        assert disk.recall_contains(keys) == 5 and len(calls) == 3
        for obj in objs:
            obj.release()
    finally:
        disk.close()


def test_remembered_answers_expire_and_stay_bounded() -> None:
    keys = make_keys(6 * CHUNK)
    memory = Existence(ttl_s=10.0, max_entries=4)
    assert memory.leading(keys) == (0, False)
    memory.remember(keys[:3], 2)  # 2 held, the 3rd not
    assert memory.leading(keys) == (2, True)
    assert memory.leading(keys, now=time.monotonic() + 11) == (0, False)  # expired
    memory.remember(keys[3:6], 3)
    assert len(memory) == 4  # the oldest went
    memory.forget(keys[3:4])
    assert memory.leading(keys[3:]) == (0, False)
    with pytest.raises(ValueError, match="max_entries"):
        Existence(max_entries=0)


def test_background_loads_never_take_the_last_worker() -> None:
    release = threading.Event()
    ran: list[str] = []

    def step(prefetch: Prefetch) -> int:
        ran.append(prefetch.keys[0].key)
        if prefetch.background:
            release.wait(HANG_BOUND_S)  # a slow tier's promotion
        return 0

    workers = Prefetcher(step, workers=2)
    try:
        slow = []
        for seed in range(3):  # promotions nobody waits for (budget 0)
            p = Prefetch(make_keys(CHUNK, seed=seed), "adaptive", budget_s=0.0)
            p.background = True
            workers.submit(p)
            slow.append(p)
        waiting = Prefetch(make_keys(CHUNK, seed=9), "adaptive", budget_s=60.0)
        workers.submit(waiting)
        assert waiting.wait_done(HANG_BOUND_S)  # served while a promotion holds a worker
        assert sum(p.done() for p in slow) == 0 and len(ran) == 2
    finally:
        release.set()
        workers.close(HANG_BOUND_S)


def test_a_request_admitted_before_its_plan_is_accounted_for(measured_disk) -> None:
    sm = measured_disk
    (disk,) = sm.lower_tiers
    for _ in range(32):
        disk.speed.observe_latency(5.0)  # no load can beat the recompute: budget 0
    sm.prefill.observe(4096, 4096 / 1000.0, 4096)
    keys = make_keys(32 * CHUNK)
    prefetch = sm.start_prefetch(keys)
    assert prefetch.ready()
    prefetch.cancel()  # admitted at once; the worker may never plan it
    assert prefetch.wait_done(HANG_BOUND_S)
    stats = sm.stats()
    counted = sum(v for k, v in stats.items() if k.startswith("adaptive_tokens_"))
    assert counted == 32 * CHUNK  # once: planned or not
    assert stats["adaptive_tokens_recomputed_slower_than_recompute"] == 32 * CHUNK


def test_a_tier_is_measured_when_it_is_built_before_any_request(tmp_path: Path) -> None:
    big = KVLayout.mha(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert big.nbytes(CHUNK) >= MIN_SAMPLE_BYTES  # a chunk long enough to time a bandwidth
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.05, local_disk=str(tmp_path / "d"),
                 max_local_disk_size=0.1)
    first = StorageManager(cfg, big)  # an earlier server's records, a short tail written last
    keys = make_keys(2 * CHUNK + 1, layout=big)
    assert big.nbytes(keys[-1].num_tokens) < MIN_SAMPLE_BYTES  # no bandwidth sample in it
    objs = [make_obj(first.allocator, big, k.num_tokens, i) for i, k in enumerate(keys)]
    with lease(objs):
        first.put(keys[:-1], objs[:-1])
        assert first.flush()
        first.put(keys[-1:], objs[-1:])  # a conversation's next turn stores only its tail
    assert first.flush()
    first.close()
    sm = StorageManager(cfg, big)  # a restart: no request has read the disk yet
    try:
        (disk,) = sm.lower_tiers
        deadline = time.monotonic() + HANG_BOUND_S
        while not disk.speed.known and time.monotonic() < deadline:
            time.sleep(0.01)
        assert disk.speed.known  # round trip and bandwidth, off any request's path
        assert sm.stats()["disk.errors"] == 0
    finally:
        sm.close()


def test_a_redis_tier_samples_a_record_of_its_namespace(redis_server) -> None:
    from tests.backends.conftest import redis_backend

    redis_server.client().flushall()
    backend = redis_backend(redis_server.url)  # namespace "default", as make_keys' keys
    try:
        assert backend.sample_read(1024) == 0  # holds nothing: nothing to time
        keys = make_keys(2 * CHUNK)
        objs = [make_obj(backend.ctx.allocator, SMALL_MHA, k.num_tokens, i)
                for i, k in enumerate(keys)]
        with lease(objs):
            assert backend.batch_put(keys, objs) == 2
        assert backend.sample_read(1024) == 1024
        other = redis_backend(redis_server.url, key_namespace="other-ns")
        try:
            assert other.sample_read(1024) == 0  # another tenant's records are not its own
        finally:
            other.close()
    finally:
        backend.close()


def test_a_redis_tier_samples_its_largest_record_not_a_short_tail(redis_server) -> None:
    from tests.backends.conftest import redis_backend

    redis_server.client().flushall()
    backend = redis_backend(redis_server.url)
    try:
        # 15 records of 2 tokens (tails: a few KB, mostly round trip) and one whole chunk: a
        # SCAN lists them in hash order, so the chunk is rarely the first
        for seed in range(16):
            keys = make_keys(CHUNK if seed == 7 else 2, seed=seed)
            objs = [make_obj(backend.ctx.allocator, SMALL_MHA, k.num_tokens, 0) for k in keys]
            with lease(objs):
                assert backend.batch_put(keys, objs) == 1
        assert backend.sample_read(1 << 30) > SMALL_MHA.nbytes(CHUNK)  # the chunk, with header
    finally:
        backend.close()
