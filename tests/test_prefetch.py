"""Background prefetch: bounded, deduplicated per chunk, cancellable, never blocking the caller."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvtier.backends import BACKENDS
from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj, lease
from kvtier.prefetch import Prefetch, Prefetcher
from kvtier.storage import StorageManager
from tests.helpers import SMALL_MHA, make_keys, make_obj, same_bytes

CHUNK = 16


class _GatedTier(CPUBackend):
    """A real in-memory tier whose reads wait for a gate and are counted per chunk: a stand-in
    for a slow network tier that a test can hold and release."""

    name = "gated"
    gate = threading.Event()
    reads: Counter[str] = Counter()
    entered = threading.Semaphore(0)

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        self.entered.release()
        self.gate.wait(30)
        out = super().batch_get(keys)
        self.reads.update(k.key for k in keys[: len(out)])
        return out


@pytest.fixture
def gated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StorageManager]:
    """CPU tier over a gated lower tier, holding three chunks only in the lower tier."""
    monkeypatch.setitem(BACKENDS, "disk", f"{__name__}:_GatedTier")
    _GatedTier.gate.set()
    _GatedTier.reads.clear()
    _GatedTier.entered = threading.Semaphore(0)
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.008, local_disk=str(tmp_path / "d"),
                 max_local_disk_size=0.1, prefetch_policy="wait_complete")
    sm = StorageManager(cfg, SMALL_MHA)
    keys = make_keys(48)
    objs = [make_obj(sm.allocator, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
    sm.want = [o.tensor.clone() for o in objs]  # type: ignore[attr-defined]
    with lease(objs):
        sm.put(keys, objs)
    assert sm.flush()
    sm.hot.remove(keys)
    _GatedTier.gate.clear()
    try:
        yield sm
    finally:
        _GatedTier.gate.set()
        arena = sm.allocator
        sm.close()
        assert arena.used_bytes == 0


def test_prefetch_returns_at_once_and_loads_in_the_background(gated: StorageManager) -> None:
    keys = make_keys(48)
    prefetch = gated.start_prefetch(keys)
    assert not prefetch.ready() and not prefetch.done()  # the tier is held: nothing blocked
    _GatedTier.gate.set()
    assert prefetch.result(timeout=30) == 3
    assert prefetch.ready()
    with gated.get(keys, hot_only=True) as objs:
        assert [same_bytes(o.tensor, w) for o, w in zip(objs, gated.want)] == [True] * 3


def test_concurrent_prefetches_read_each_chunk_once(gated: StorageManager) -> None:
    keys = make_keys(48)
    first = gated.start_prefetch(keys)
    assert _GatedTier.entered.acquire(timeout=30)  # the first one is reading
    second = gated.start_prefetch(keys)
    _GatedTier.gate.set()
    assert first.result(timeout=30) == 3 and second.result(timeout=30) == 3
    assert sorted(_GatedTier.reads.values()) == [1, 1, 1]


def test_cancelled_prefetch_with_drop_gives_its_memory_back(gated: StorageManager) -> None:
    keys = make_keys(48)
    start = gated.allocator.used_bytes
    prefetch = gated.start_prefetch(keys)
    assert _GatedTier.entered.acquire(timeout=30)
    prefetch.cancel(drop=True)  # while its read is in flight
    _GatedTier.gate.set()
    prefetch.result(timeout=30)
    assert gated.hot.batch_contains(keys) == 0
    assert gated.allocator.used_bytes == start
    assert gated.stats()["prefetch_dropped_chunks"] == 3


def test_cancel_stops_before_the_next_window_and_keeps_what_arrived(
        gated: StorageManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvtier.storage.PREFETCH_WINDOW", 1)
    keys = make_keys(48)
    prefetch = gated.start_prefetch(keys)
    assert _GatedTier.entered.acquire(timeout=30)
    prefetch.cancel()
    _GatedTier.gate.set()
    assert prefetch.result(timeout=30) == 1
    assert gated.hot.batch_contains(keys) == 1


def test_prefetcher_is_bounded_and_close_does_not_run_the_queue() -> None:
    release = threading.Event()
    ran: list[Prefetch] = []
    dropped: list[int] = []

    def load(p: Prefetch) -> int:
        ran.append(p)
        release.wait(30)
        return 1

    pf = Prefetcher(load, workers=1, max_pending=2, on_dropped=lambda: dropped.append(1))
    running = Prefetch([])
    assert pf.submit(running)
    while not ran:  # the worker took it: the queue is empty again
        release.wait(0.001)
    queued = [Prefetch([]) for _ in range(2)]
    assert all(pf.submit(p) for p in queued)
    refused = Prefetch([])
    assert not pf.submit(refused)
    assert refused.done() and refused.result() == 0 and dropped == [1]
    release.set()
    pf.close(timeout=30)
    assert running.result(timeout=0) == 1
    assert len(ran) <= 3 and all(p.done() for p in queued)


@pytest.mark.parametrize("policy, ready", [("best_effort", True), ("wait_complete", False),
                                           ("timeout", False)])
def test_ready_follows_the_policy(policy: str, ready: bool) -> None:
    prefetch = Prefetch(make_keys(32), policy, budget_s=60.0)
    assert prefetch.ready() is ready
    assert prefetch.ready(now=prefetch.started + 61.0) is (policy != "wait_complete")
    prefetch.finish(2)
    assert prefetch.ready() and prefetch.result() == 2


def test_bad_policy_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="policy"):
        Prefetch([], "eventually")
