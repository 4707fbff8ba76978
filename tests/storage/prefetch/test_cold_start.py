"""Never slower from the first request: a guess never costs a wait, a tier slower than recompute
is not asked on the admission path, and a repeated prefix asks no second round trip."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvtier.backends import BackendContext, ProbeSample, StorageBackend
from kvtier.backends.disk import DiskBackend
from kvtier.backends.disk.probe import scratch_files
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, MemoryObj, lease
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage import StorageManager, tierset
from kvtier.storage.existence import Existence
from kvtier.storage.guard import MIN_SAMPLE_BYTES, GuardedTier
from kvtier.storage.prefetch.estimates import PrefillSpeed
from kvtier.storage.prefetch.handle import Prefetch
from kvtier.storage.prefetch.planner import LoadPlanner
from kvtier.storage.prefetch.policy import prefetch_policy
from kvtier.storage.prefetch.workers import Prefetcher
from tests.helpers import SMALL_MHA, make_keys, make_obj, use_backend

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
    use_backend(monkeypatch, "redis", f"{__name__}:SilentTier")
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
        engine.prefill.observe(4096, 4096 / 100.0, 4096)  # recompute is slow: loads would pay
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
            planner.plan(Prefetch(keys, prefetch_policy("adaptive"), budget_s=0.0), 0)
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
            p = Prefetch(make_keys(CHUNK, seed=seed), prefetch_policy("adaptive"), budget_s=0.0)
            p.background = True
            workers.submit(p)
            slow.append(p)
        waiting = Prefetch(make_keys(CHUNK, seed=9), prefetch_policy("adaptive"), budget_s=60.0)
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


def test_empty_tiers_are_measured_before_the_engine_is_built(tmp_path: Path,
                                                              redis_server) -> None:
    redis_server.client().flushall()
    assert SMALL_MHA.nbytes(CHUNK) < MIN_SAMPLE_BYTES  # a chunk too small to time a bandwidth
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.05, local_disk=str(tmp_path / "d"),
                 max_local_disk_size=0.1, remote_url=redis_server.url)
    sm = StorageManager(cfg, SMALL_MHA)  # a first start: nothing stored anywhere
    try:
        assert [t.name for t in sm.lower_tiers] == ["disk", "redis"]
        # No waiting: measured when the constructor returns (a server's first request).
        assert all(t.speed.known for t in sm.lower_tiers)
        assert int(redis_server.client().dbsize()) == 0  # the probes left nothing
        assert scratch_files(tmp_path / "d") == []
        stats = sm.stats()
        assert stats["disk.errors"] == stats["redis.errors"] == 0
        assert stats["disk.puts"] == stats["redis.puts"] == 0
    finally:
        sm.close()


class MuteProbe(SilentTier):
    """A remote tier whose probe never answers (its other calls too)."""

    def probe(self, nbytes: int) -> list[ProbeSample]:
        self._hang()
        return []


def test_a_probe_that_does_not_answer_is_given_up_after_its_bound(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    MuteProbe.released.clear()
    MuteProbe.asked.clear()
    use_backend(monkeypatch, "redis", f"{__name__}:MuteProbe")
    monkeypatch.setattr(tierset, "PROBE_BOUND_S", 0.2)
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.016, remote_url="redis://127.0.0.1:1",
                 blocking_timeout_secs=1.0)
    caplog.set_level(logging.INFO, logger="kvtier")
    start = time.monotonic()
    sm = StorageManager(cfg, SMALL_MHA)
    try:
        assert time.monotonic() - start < HANG_BOUND_S  # a bound on a hang, not a timing
        assert MuteProbe.asked == ["kvtier-probe-redis"]  # on a thread of its own
        (redis,) = sm.lower_tiers
        assert not redis.speed.known
        assert "tier redis: its start-up probe did not finish within 0.2s" in caplog.text
    finally:
        MuteProbe.released.set()
        sm.close()


def test_a_tier_attached_at_run_time_is_measured_before_it_serves(tmp_path: Path) -> None:
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.05, local_disk=str(tmp_path / "d"),
                 max_local_disk_size=0.1)
    sm = StorageManager(replace(cfg, local_disk=None), SMALL_MHA)
    try:
        assert sm.lower_tiers == []
        sm.attach_tier("disk", cfg)
        (disk,) = sm.lower_tiers
        assert disk.speed.known
    finally:
        sm.close()


@contextlib.contextmanager
def _redis_manager(url: str) -> Iterator[StorageManager]:
    """A fresh CPU tier over Redis at `url` (its speeds timed by its start-up probe)."""
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.008, remote_url=url,
                 remote_timeout_secs=5.0)
    sm = StorageManager(cfg, SMALL_MHA)
    try:
        yield sm
    finally:
        sm.close()


def test_a_far_redis_holds_no_request_for_its_lookup_and_a_near_one_loads_at_once(
        redis_server, request: pytest.FixtureRequest) -> None:
    """Issue 67: Redis 150 ms away at 2 MB/s. One round trip and the transfer are less than
    the recompute, so a load might look worth waiting for, but the lookup's round trip comes
    on top: nothing can be saved, and the request is admitted at once. The same Redis reached
    directly (a near mirror) loads the prompt on the manager's very first request."""
    from harness.delay_proxy import DelayProxy

    model = f"far-near-{request.node.name}"
    keys = make_keys(32 * CHUNK, model=model)
    with _redis_manager(redis_server.url) as writer:
        objs = [make_obj(writer.allocator, SMALL_MHA, k.num_tokens, i)
                for i, k in enumerate(keys)]
        with lease(objs):
            writer.put(keys, objs)
        assert writer.flush()

    with DelayProxy(redis_server.port, 0.15, bytes_per_s=2e6) as proxy, \
            _redis_manager(proxy.url) as far:
        (tier,) = far.lower_tiers
        assert tier.speed.known, tier.speed.stats()  # timed by its start-up probe
        rtt, transfer = tier.speed.latency_s, SMALL_MHA.nbytes(len(keys) * CHUNK) \
            / tier.speed.read_bytes_per_s
        # Recomputing takes 1.5 round trips plus the transfer: more than a read, less than a
        # lookup and a read.
        recompute = 1.5 * rtt + transfer
        far.prefill.observe(len(keys) * CHUNK, recompute, len(keys) * CHUNK)
        prefetch = far.start_prefetch(keys)
        assert prefetch.ready(), far.stats()  # admitted before any round trip
        assert prefetch.wait_done(HANG_BOUND_S)

    with _redis_manager(redis_server.url) as near:
        near.prefill.observe(len(keys) * CHUNK, 1.5 * recompute, len(keys) * CHUNK)
        prefetch = near.start_prefetch(keys)
        assert not prefetch.ready()  # worth waiting for: a load saves most of the recompute
        assert prefetch.wait_done(HANG_BOUND_S)
        assert prefetch.result() == len(keys)
        assert near.stats()["adaptive_tokens_loaded"] == len(keys) * CHUNK
