"""Every chunk handed to a lower-tier writer is accounted for once: written, held already, or
lost under one reason (a full queue, a tier that did not take it, an orphan, a close out of
time); `write_backlog` reads what a stop reports from those counters."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvtier.backends import BackendContext
from kvtier.backends.disk import DiskBackend
from kvtier.background import EngineActivity
from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, MemoryObj, lease
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage.backlog import WriteBacklog, WriteLoss, write_backlog
from kvtier.storage.writer import TierWriter
from tests.helpers import SMALL_MHA, make_keys, make_obj

CHUNK = 16
BOUND_S = 30.0  # a bound on a hang, never expected to pass


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[tuple[DiskBackend, MemoryAllocator]]:
    cfg = Config(chunk_size=CHUNK, local_disk=str(tmp_path / "d"), max_local_disk_size=0.1)
    alloc = MemoryAllocator(1 << 24)
    backend = DiskBackend(BackendContext(config=cfg, layout=SMALL_MHA, allocator=alloc))
    yield backend, alloc
    backend.close()


class _Stuck:
    """A `batch_put` that waits for `gate` (a tier that stopped answering), then writes."""

    def __init__(self, put: object) -> None:
        self.put = put
        self.started = threading.Event()
        self.gate = threading.Event()

    def __call__(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        self.started.set()
        assert self.gate.wait(BOUND_S)
        return self.put(keys, objs)  # type: ignore[operator]


def _writer(backend: DiskBackend, capacity: int = 64) -> tuple[TierWriter, Counters]:
    counters = Counters()
    writer = TierWriter(backend, capacity, counters,
                        RateLimitedLog(logging.getLogger(__name__)), engine=EngineActivity())
    return writer, counters


def _submit(writer: TierWriter, alloc: MemoryAllocator, chunks: int, seed: int) -> int:
    keys = make_keys(chunks * CHUNK, seed=seed)
    objs = [make_obj(alloc, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
    with lease(objs):
        return writer.submit(keys, objs)


def _backlog(writer: TierWriter, counters: Counters) -> WriteBacklog:
    return write_backlog(counters, writer.pending())


def test_writes_a_tier_does_not_take_are_counted_lost(
        disk: tuple[DiskBackend, MemoryAllocator], monkeypatch: pytest.MonkeyPatch) -> None:
    """A guarded tier answers a failure (an error, a timeout, the tier down) with 0 written:
    those chunks were lost without a count before."""
    backend, alloc = disk
    monkeypatch.setattr(backend, "batch_put", lambda keys, objs: 0)
    writer, counters = _writer(backend)
    try:
        assert _submit(writer, alloc, 4, seed=1) == 4
        assert writer.drain(BOUND_S)
        backlog = _backlog(writer, counters)
        (loss,) = backlog.lost
        # the worker may take the first chunk alone: its successors are then orphans
        assert (backlog.written, backlog.pending, loss.total) == (0, 0, 4), backlog
        assert loss.failed >= 1 and loss.failed + loss.orphaned == 4, loss
        assert counters.snapshot()[f"{backend.name}.writes_lost"] == 4
        assert str(loss).startswith(f"{backend.name} 4 (")
    finally:
        writer.close(BOUND_S)
    assert alloc.used_bytes == 0


def test_a_full_queue_and_a_close_out_of_time_are_counted_lost(
        disk: tuple[DiskBackend, MemoryAllocator], monkeypatch: pytest.MonkeyPatch) -> None:
    backend, alloc = disk
    stuck = _Stuck(backend.batch_put)
    monkeypatch.setattr(backend, "batch_put", stuck)
    writer, counters = _writer(backend, capacity=2)
    try:
        assert _submit(writer, alloc, 1, seed=1) == 1
        assert stuck.started.wait(BOUND_S)  # the worker holds it, waiting on the tier
        assert _submit(writer, alloc, 5, seed=2) == 2  # 3 refused: the queue holds 2
        assert writer.pending() == 3  # 2 queued, 1 being written
        writer.close(0.2)  # the tier still does not answer: the 2 queued are discarded
        assert _backlog(writer, counters).lost == (WriteLoss(backend.name, 3, 0, 0, 2),)
        stuck.gate.set()
        assert writer.drain(BOUND_S)  # the write in flight ends, then the worker
        assert _submit(writer, alloc, 1, seed=3) == 0  # closed: refused, and counted
    finally:
        stuck.gate.set()
        writer.close(BOUND_S)
    backlog = _backlog(writer, counters)
    assert backlog.lost == (WriteLoss(backend.name, 3, 0, 0, 3),), backlog
    assert counters.snapshot()[f"{backend.name}.write_dropped"] == 3
    # every chunk handed over counted once: the one in flight written when the tier answered
    assert (backlog.written, backlog.pending) == (1, 0)
    assert backlog.written + backlog.lost_total == 1 + 5 + 1
    assert alloc.used_bytes == 0
