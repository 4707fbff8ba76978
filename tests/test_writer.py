"""A lower-tier writer on a CPU engine: while batches run it writes only its share of the time,
the rest after the burst, within a bounded backlog; a GPU engine (the activity signal not
enabled) is never waited for."""

from __future__ import annotations

import logging
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
    """A writer that, after its first write, writes nothing more while `engine` is busy (a
    share so small that the wait it allows outlasts any test)."""
    counters = Counters()
    return TierWriter(backend, capacity, counters, RateLimitedLog(logging.getLogger(__name__)),
                      engine=engine, busy_share=1e-9), counters


def _first_write(writer: TierWriter, alloc: MemoryAllocator) -> None:
    """The writer's first write: nothing before it to pay for, so not held back."""
    _submit(writer, alloc, 1, seed=99)
    assert writer.drain(BOUND_S)


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
    assert engine.busy()
    engine.leave()
    now = time.monotonic()
    assert engine.busy(now) and not engine.busy(now + QUIET_S)
    assert engine.wait_quiet(BOUND_S) >= 0 and not engine.busy()
    engine.enter()  # a batch whose result never comes does not hold writers forever
    assert engine.busy() and not engine.busy(time.monotonic() + STALE_S)


def test_writes_wait_for_a_busy_cpu_engine_and_follow_it(
        disk: tuple[DiskBackend, MemoryAllocator]) -> None:
    backend, alloc = disk
    engine = _busy_engine()
    writer, counters = _writer(backend, engine)
    try:
        _first_write(writer, alloc)
        keys = _submit(writer, alloc, 4)
        time.sleep(SETTLE_S)
        assert backend.batch_contains(keys) == 0  # still waiting: a batch runs
        engine.leave()
        assert writer.drain(BOUND_S)
        assert backend.batch_contains(keys) == 4
        assert counters.snapshot(declared=True)[f"{backend.name}.write_deferrals"] >= 1
    finally:
        writer.close(BOUND_S)


def test_a_backlog_of_half_the_queue_is_written_even_while_busy(
        disk: tuple[DiskBackend, MemoryAllocator]) -> None:
    backend, alloc = disk
    engine = _busy_engine()
    writer, _ = _writer(backend, engine, capacity=8)
    try:
        _first_write(writer, alloc)
        keys = _submit(writer, alloc, 7)
        # The engine stays busy, yet the writer brings the backlog below half of 8.
        deadline = time.monotonic() + BOUND_S
        while backend.batch_contains(keys) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.batch_contains(keys) >= 3 and engine.busy()
        engine.leave()
        assert writer.drain(BOUND_S) and backend.batch_contains(keys) == 7
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
    _first_write(writer, alloc)
    keys = _submit(writer, alloc, 3)
    writer.close(BOUND_S)  # stops waiting at once: the queue is written, then the worker ends
    assert backend.batch_contains(keys) == 3
    assert alloc.used_bytes == 0  # every reference released
