"""A lower-tier writer on a CPU engine: while batches run it holds its writes for after the
burst, within a bounded backlog and a bounded wait, then writes only its share of the time; a
GPU engine (the activity signal not enabled) is never waited for."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.backends import BackendContext
from kvtier.backends.disk import DiskBackend
from kvtier.background import QUIET_S, STALE_S, EngineActivity
from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, lease
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage import writer as writer_module
from kvtier.storage.writer import TierWriter
from tests.helpers import SMALL_MHA, make_keys, make_obj

CHUNK = 16
BOUND_S = 30.0  # a bound on a hang, never expected to pass
SETTLE_S = 0.3  # long enough for a writer that does not wait to have written a few chunks


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[tuple[DiskBackend, MemoryAllocator]]:
    cfg = Config(chunk_size=CHUNK, local_disk=str(tmp_path / "d"), max_local_disk_size=0.1)
    alloc = MemoryAllocator(1 << 24)
    backend = DiskBackend(BackendContext(config=cfg, layout=SMALL_MHA, allocator=alloc))
    yield backend, alloc
    backend.close()


def _writer(backend: DiskBackend, engine: EngineActivity, capacity: int = 64,
            ) -> tuple[TierWriter, Counters]:
    """A writer whose share of a busy engine's time is so small that, once its hold is over,
    the wait between two writes outlasts any test."""
    counters = Counters()
    return TierWriter(backend, capacity, counters, RateLimitedLog(logging.getLogger(__name__)),
                      engine=engine, busy_share=1e-9), counters


def _submit(writer: TierWriter, alloc: MemoryAllocator, chunks: int, seed: int = 0,
            ) -> list[ChunkKey]:
    keys = make_keys(chunks * CHUNK, seed=seed)
    objs = [make_obj(alloc, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
    with lease(objs):
        assert writer.submit(keys, objs) == chunks
    return keys


def _busy_engine() -> EngineActivity:
    engine = EngineActivity()
    engine.enabled = True
    engine.enter()  # a batch runs until the test says leave()
    return engine


def test_the_engine_is_busy_while_a_batch_runs_and_shortly_after() -> None:
    engine = EngineActivity()
    engine.enter()
    assert not engine.busy()  # not enabled: a GPU engine leaves the CPU to kvtier
    engine.enabled = True
    assert engine.busy() and engine.quiet_in() == math.inf
    engine.leave()
    now = time.monotonic()
    assert engine.busy(now) and not engine.busy(now + QUIET_S)
    assert 0 < engine.quiet_in(now) <= QUIET_S and engine.quiet_in(now + QUIET_S) == 0
    assert engine.wait_quiet(BOUND_S) >= 0 and not engine.busy()
    engine.enter()  # a batch whose result never comes does not hold writers forever
    assert engine.busy() and not engine.busy(time.monotonic() + STALE_S)


def test_queued_requests_keep_the_engine_busy_between_batches() -> None:
    """A turn without a batch while requests wait (for a store's slots, a prefetch, room in
    the pool) is the moment before a forward pass, not a quiet one."""
    engine = EngineActivity()
    engine.enabled = True
    engine.enter()
    engine.leave(waiting=True)
    now = time.monotonic()
    assert engine.busy(now + QUIET_S) and engine.quiet_in(now + QUIET_S) == math.inf
    engine.idle(waiting=True)  # a turn that ran nothing: still waiting
    assert engine.busy(time.monotonic() + QUIET_S)
    engine.idle(waiting=False)  # the queue emptied (served, aborted)
    assert not engine.busy(time.monotonic() + QUIET_S)
    engine.idle(waiting=True)  # an engine that stops reporting does not hold writers forever
    assert engine.busy() and not engine.busy(time.monotonic() + STALE_S)
    engine.enter()
    engine.leave(waiting=False)  # a batch's result with nothing queued: quiet after QUIET_S
    assert not engine.busy(time.monotonic() + QUIET_S)


def test_a_waiter_on_a_busy_engine_wakes_five_times_a_second_at_most() -> None:
    """Each wake-up takes a thread switch and the GIL from the engine. An upper bound on the
    count only: a late wake-up (a busy host) makes fewer of them, never more."""
    engine = EngineActivity()
    engine.enabled = True
    engine.enter()  # a batch runs throughout
    wakes: list[float] = []
    engine.wait_quiet(1.0, lambda: bool(wakes.append(time.monotonic())))
    assert len(wakes) <= 6  # the first look, then one every 200 ms


def _written(backend: DiskBackend, keys: list[ChunkKey], at_least: int) -> int:
    """How many of `keys` the tier holds, once it holds `at_least` (or `BOUND_S` ran out)."""
    deadline = time.monotonic() + BOUND_S
    while backend.batch_contains(keys) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return backend.batch_contains(keys)


def test_writes_wait_for_a_busy_cpu_engine_and_follow_it(
        disk: tuple[DiskBackend, MemoryAllocator]) -> None:
    backend, alloc = disk
    engine = _busy_engine()
    writer, counters = _writer(backend, engine)
    try:
        keys = _submit(writer, alloc, 4)
        time.sleep(SETTLE_S)
        assert backend.batch_contains(keys) == 0  # still waiting: a batch runs
        engine.leave()
        assert writer.drain(BOUND_S)
        assert backend.batch_contains(keys) == 4
        assert counters.snapshot(declared=True)[f"{backend.name}.write_deferrals"] >= 1
    finally:
        writer.close(BOUND_S)


def test_a_write_is_held_for_a_bounded_time(disk: tuple[DiskBackend, MemoryAllocator],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    backend, alloc = disk
    monkeypatch.setattr(writer_module, "HOLD_S", SETTLE_S)
    engine = _busy_engine()
    writer, _ = _writer(backend, engine)
    try:
        keys = _submit(writer, alloc, 1)
        assert _written(backend, keys, 1) == 1 and engine.busy()  # busy throughout
    finally:
        writer.close(BOUND_S)


def test_a_long_backlog_is_paced_then_written_at_once_while_busy(
        disk: tuple[DiskBackend, MemoryAllocator]) -> None:
    backend, alloc = disk
    engine = _busy_engine()
    writer, _ = _writer(backend, engine, capacity=8)  # held below 6 waiting, urgent from 7
    try:
        keys = _submit(writer, alloc, 7)
        # 6 waiting behind the first: past the hold, one paced write (of 2 chunks) goes out,
        # then 4 wait behind the next, and are held.
        assert _written(backend, keys, 2) == 2
        time.sleep(SETTLE_S)
        assert backend.batch_contains(keys) == 2 and engine.busy()
        # 4 + 3 waiting: urgent, written although the pace (1e-9 of the time) would not allow.
        more = _submit(writer, alloc, 3, seed=1)
        assert _written(backend, keys, 4) >= 4 and engine.busy()
        engine.leave()
        assert writer.drain(BOUND_S)
        assert backend.batch_contains(keys) == 7 and backend.batch_contains(more) == 3
    finally:
        writer.close(BOUND_S)


def test_a_gpu_engine_is_never_waited_for(disk: tuple[DiskBackend, MemoryAllocator]) -> None:
    backend, alloc = disk
    engine = EngineActivity()
    engine.enter()  # running, but not enabled
    writer, counters = _writer(backend, engine)
    try:
        keys = _submit(writer, alloc, 2)
        assert writer.drain(BOUND_S)
        assert backend.batch_contains(keys) == 2
        assert counters.snapshot(declared=True)[f"{backend.name}.write_deferrals"] == 0
    finally:
        writer.close(BOUND_S)


def test_close_writes_what_waits_for_a_busy_engine(
        disk: tuple[DiskBackend, MemoryAllocator]) -> None:
    backend, alloc = disk
    writer, _ = _writer(backend, _busy_engine())
    keys = _submit(writer, alloc, 3)
    writer.close(BOUND_S)  # stops waiting at once: the queue is written, then the worker ends
    assert backend.batch_contains(keys) == 3
    assert alloc.used_bytes == 0  # every reference released
