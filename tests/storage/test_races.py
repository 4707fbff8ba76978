"""Races in the storage layer, each provoked on purpose: a writer closed while threads submit,
a manager closed while threads put and ask for stats, a tier detached under load. (A prefetch's
drop racing the end of its load: tests/storage/prefetch/test_loads.py.)

Interleavings that matter are forced with events where the code has a place to hold a thread;
the stress tests around them run many threads with a short switch interval. A bounded wait
(`join(HOLD_S)`) only gives code without the fix the time to go wrong: no assertion depends on
how long anything took.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, MemoryObj
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage import StorageManager
from kvtier.storage.writer import TierWriter
from tests.helpers import SMALL_MHA, make_keys, make_obj, run_threads, use_backend

CHUNK = 16
HOLD_S = 1.0  # how long a held thread waits for a fixed close that cannot run meanwhile
BOUND_S = 30.0  # a bound on a hang, never expected to pass


@pytest.fixture
def switch_often() -> Iterator[None]:
    """Switch threads every few microseconds, so races get many chances to happen."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def _objs(alloc: MemoryAllocator, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
    return [make_obj(alloc, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]


def _release_all(alloc: MemoryAllocator, objs: Sequence[MemoryObj]) -> None:
    """The test's own references are the only ones left: release them, the arena is empty."""
    assert [o.refs for o in objs] == [1] * len(objs)
    for obj in objs:
        obj.release()
    alloc.check_integrity()
    assert alloc.used_bytes == 0


# -- TierWriter: submit racing close/cancel --------------------------------------------------


class _Sink:
    """A lower tier that takes every write and keeps nothing (no references)."""

    name = "sink"

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        return len(keys)

    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        return 0


def _writer(capacity: int = 64) -> TierWriter:
    return TierWriter(_Sink(), capacity, Counters(),  # type: ignore[arg-type]
                      RateLimitedLog(logging.getLogger(__name__)))


class _HeldRetain:
    """A memory object whose `retain()` (where `submit` takes its reference, between its
    closed check and the enqueue) holds until the test lets it go."""

    def __init__(self, obj: MemoryObj) -> None:
        self.obj = obj
        self.entered = threading.Event()
        self.go = threading.Event()

    def retain(self) -> _HeldRetain:
        self.entered.set()
        self.go.wait(BOUND_S)
        self.obj.retain()
        return self

    def release(self) -> None:
        self.obj.release()


@pytest.mark.parametrize("stop", ["close", "cancel"])
def test_a_submit_caught_by_close_is_released(stop: str) -> None:
    alloc = MemoryAllocator(1 << 20)
    key = make_keys(CHUNK)[0]
    obj = make_obj(alloc, SMALL_MHA, key.num_tokens, 0)
    held = _HeldRetain(obj)
    writer = _writer()
    submitter = threading.Thread(target=writer.submit, args=([key], [held]))
    submitter.start()
    assert held.entered.wait(BOUND_S)  # past the closed check, not yet queued
    stopper = threading.Thread(target=getattr(writer, stop), args=(BOUND_S,))
    stopper.start()
    stopper.join(HOLD_S)  # without the fix the writer is closed by now
    held.go.set()
    submitter.join(BOUND_S)
    stopper.join(BOUND_S)
    assert not submitter.is_alive() and not stopper.is_alive()
    _release_all(alloc, [obj])


@pytest.mark.parametrize("stop", ["close", "cancel"])
def test_many_submitters_racing_close_leak_nothing(stop: str, switch_often: None) -> None:
    alloc = MemoryAllocator(1 << 22)
    keys = make_keys(CHUNK * 8)
    objs = _objs(alloc, keys)
    for _ in range(50):
        _race_writer(_writer(capacity=8), stop, keys, objs)  # small: some submits drop
        assert [o.refs for o in objs] == [1] * len(objs)
    _release_all(alloc, objs)


def _race_writer(writer: TierWriter, stop: str, keys: list[ChunkKey],
                 objs: list[MemoryObj]) -> None:
    """Eight threads submit to `writer` while a ninth stops it (`close` or `cancel`)."""
    barrier = threading.Barrier(9)

    def run(i: int) -> None:
        barrier.wait()
        if i == 8:
            getattr(writer, stop)(BOUND_S)
            return
        for _ in range(50):
            writer.submit(keys[i:], objs[i:])

    run_threads(run, [(i,) for i in range(9)])


# -- StorageManager: close racing put/stats/contains, detach under load ----------------------


class _WatchedTier(CPUBackend):
    """A real in-memory tier that notes every call made after it was closed."""

    late: list[str] = []

    def __init__(self, ctx: object) -> None:
        super().__init__(ctx)  # type: ignore[arg-type]
        self.closed = False

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        self._note("batch_put")
        return super().batch_put(keys, objs)

    def stats(self) -> dict[str, float]:
        self._note("stats")
        return super().stats()

    def close(self) -> None:
        self.closed = True
        super().close()

    def _note(self, call: str) -> None:
        if self.closed:
            self.late.append(f"{self.name}.{call}")


class _WatchedDisk(_WatchedTier):
    name = "disk"
    stats_entered = threading.Event()
    stats_go = threading.Event()

    def stats(self) -> dict[str, float]:
        out = super().stats()
        self.stats_entered.set()
        # Without the fix, the redis tier's close lets this go on; with it, close waits for
        # this call, nobody sets the event, and it goes on after HOLD_S.
        self.stats_go.wait(HOLD_S)
        return out


class _WatchedRedis(_WatchedTier):
    name = "redis"

    def close(self) -> None:
        super().close()
        _WatchedDisk.stats_go.set()  # without the fix: let the held stats() go on now


@pytest.fixture
def watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StorageManager]:
    """A manager over two watched lower tiers ("disk" then "redis")."""
    use_backend(monkeypatch, "disk", f"{__name__}:_WatchedDisk")
    use_backend(monkeypatch, "redis", f"{__name__}:_WatchedRedis")
    _WatchedTier.late = []
    _WatchedDisk.stats_entered = threading.Event()
    _WatchedDisk.stats_go = threading.Event()
    _WatchedDisk.stats_go.set()  # held only where a test clears it
    sm = StorageManager(_config(tmp_path, remote_url="redis://127.0.0.1:1"), SMALL_MHA)
    yield sm
    sm.close()
    sm.allocator.check_integrity()


def _config(tmp_path: Path, **kw: object) -> Config:
    args: dict = {"chunk_size": CHUNK, "max_local_cpu_size": 0.008,
                  "local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.1,
                  "blocking_timeout_secs": BOUND_S}
    args.update(kw)
    return Config(**args)


def test_stats_running_when_close_starts_never_reaches_a_closed_tier(
        watched: StorageManager) -> None:
    _WatchedDisk.stats_go.clear()
    out: list[dict[str, float]] = []
    asker = threading.Thread(target=lambda: out.append(watched.stats()))
    asker.start()
    assert _WatchedDisk.stats_entered.wait(BOUND_S)  # held inside the disk tier's stats
    closer = threading.Thread(target=watched.close)
    closer.start()
    asker.join(BOUND_S)
    closer.join(BOUND_S)
    assert not asker.is_alive() and not closer.is_alive()
    assert _WatchedTier.late == []
    assert "redis.entries" in out[0]
    assert "redis.entries" not in watched.stats()  # closed: counters only


def test_close_under_put_stats_contains_raises_nothing(watched: StorageManager,
                                                      switch_often: None) -> None:
    alloc = watched.allocator
    prompts = [make_keys(CHUNK * 4, seed=i) for i in range(4)]
    objs = [_objs(alloc, keys) for keys in prompts]
    barrier = threading.Barrier(5)
    done = threading.Event()  # set however the closer ends, so no worker runs on forever

    def work(i: int) -> None:
        barrier.wait()
        while not done.is_set():
            watched.put(prompts[i], objs[i])
            watched.stats()
            watched.contains(prompts[i])

    def close(_: int) -> None:
        try:
            barrier.wait()
            while watched.stats().get("chunks_put", 0) < 64:  # everyone is at work
                pass
            watched.close()
        finally:
            done.set()

    run_threads(lambda i: close(i) if i == 4 else work(i), [(i,) for i in range(5)])
    assert _WatchedTier.late == []
    for held in objs:
        assert [o.refs for o in held] == [1] * len(held)
        for obj in held:
            obj.release()
    alloc.check_integrity()
    assert alloc.used_bytes == 0


def test_a_put_during_close_is_refused(watched: StorageManager,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    entered, go = threading.Event(), threading.Event()
    on_close = watched.policy.on_close

    def held_on_close(*args: object) -> None:
        entered.set()
        go.wait(BOUND_S)
        on_close(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(watched.policy, "on_close", held_on_close)
    closer = threading.Thread(target=watched.close)
    closer.start()
    assert entered.wait(BOUND_S)  # close is handing the CPU tier down: the writers are open
    keys = make_keys(CHUNK * 2)
    objs = _objs(watched.allocator, keys)
    watched.put(keys, objs)
    assert watched.hot.batch_contains(keys) == 0
    assert watched.stats().get("chunks_put", 0) == 0
    go.set()
    closer.join(BOUND_S)
    assert not closer.is_alive() and _WatchedTier.late == []
    _release_all(watched.allocator, objs)


def test_a_put_running_when_close_starts_is_written_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sm = StorageManager(_config(tmp_path, write_policy="write_back"), SMALL_MHA)
    keys = make_keys(CHUNK * 2)
    objs = _objs(sm.allocator, keys)
    entered, go = threading.Event(), threading.Event()
    batch_put, on_close = sm.hot.batch_put, sm.policy.on_close

    def held_put(keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        entered.set()
        go.wait(BOUND_S)
        stored = batch_put(keys, objs)
        for obj in objs:  # the caller lets go at once: only the CPU tier holds them now
            obj.release()
        return stored

    def on_close_then_go(*args: object) -> None:
        on_close(*args)  # type: ignore[arg-type]
        go.set()  # without the fix: the put lands only now, after the CPU tier was handed down

    monkeypatch.setattr(sm.hot, "batch_put", held_put)
    monkeypatch.setattr(sm.policy, "on_close", on_close_then_go)
    putter = threading.Thread(target=sm.put, args=(keys, objs))
    putter.start()
    assert entered.wait(BOUND_S)  # the put is past its closed check
    closer = threading.Thread(target=sm.close)
    closer.start()
    while not sm.closed:  # close refuses new calls first, then waits for this put
        closer.join(0.001)
    go.set()
    putter.join(BOUND_S)
    closer.join(BOUND_S)
    assert not putter.is_alive() and not closer.is_alive()
    sm.allocator.check_integrity()
    assert sm.allocator.used_bytes == 0
    again = StorageManager(_config(tmp_path, local_cpu=False), SMALL_MHA)
    try:
        assert again.contains(keys) == 2  # write-back handed it down at close
    finally:
        again.close()


@pytest.mark.parametrize("drain", [True, False])
def test_detach_under_put_load_leaks_nothing(tmp_path: Path, drain: bool,
                                             switch_often: None) -> None:
    cfg = _config(tmp_path, write_queue_chunks=8)  # small: puts keep finding it full
    sm = StorageManager(cfg, SMALL_MHA)
    alloc = sm.allocator
    prompts = [make_keys(CHUNK * 4, seed=i) for i in range(4)]
    objs = [_objs(alloc, keys) for keys in prompts]
    done = threading.Event()  # set however the detacher ends, so no worker runs on forever
    barrier = threading.Barrier(5)

    def work(i: int) -> None:
        barrier.wait()
        while not done.is_set():
            sm.put(prompts[i], objs[i])

    def detach(_: int) -> None:
        try:
            barrier.wait()
            for cycle in range(10):
                target = 64 * (cycle + 1)
                while sm.stats().get("chunks_put", 0) < target:  # stores are running
                    pass
                sm.detach_tier("disk", drain=drain)  # its writer stops under the puts
                sm.attach_tier("disk", cfg)
        finally:
            done.set()

    run_threads(lambda i: detach(i) if i == 4 else work(i), [(i,) for i in range(5)])
    assert sm.stats()["tier_detached"] == 10
    sm.close()
    _release_all(alloc, [obj for held in objs for obj in held])
