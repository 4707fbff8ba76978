"""Background prefetch through the storage manager, over a lower tier a test holds and
releases: returning at once, one read per chunk, cancels and aborts, bounded queues, turns
and stalls (the `Prefetch` and `Prefetcher` pieces alone: test_handle.py, test_workers.py)."""

from __future__ import annotations

import gc
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj, lease
from kvtier.storage import StorageManager
from kvtier.storage.prefetch.handle import Prefetch
from tests.helpers import SMALL_MHA, make_keys, make_obj, same_bytes, use_backend

CHUNK = 16


class _GatedTier(CPUBackend):
    """A real in-memory tier whose reads wait for a gate and are counted per chunk: a stand-in
    for a slow network tier that a test can hold and release."""

    name = "gated"
    gate = threading.Event()
    reads: Counter[str] = Counter()
    order: list[str] = []  # every chunk read, in order
    entered = threading.Semaphore(0)

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        self.entered.release()
        self.gate.wait(30)
        out = super().batch_get(keys)
        self.reads.update(k.key for k in keys[: len(out)])
        self.order.extend(k.key for k in keys[: len(out)])
        return out


@pytest.fixture
def gated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StorageManager]:
    """CPU tier over a gated lower tier, holding three chunks only in the lower tier."""
    sm = _gated_manager(tmp_path, monkeypatch)
    try:
        yield sm
    finally:
        _GatedTier.gate.set()
        arena = sm.allocator
        sm.close()
        assert arena.used_bytes == 0


def _gated_manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   policy: str = "wait_complete") -> StorageManager:
    """The `gated` fixture's manager, its gate closed; the caller closes it."""
    use_backend(monkeypatch, "disk", f"{__name__}:_GatedTier")
    _GatedTier.gate.set()
    _GatedTier.reads.clear()
    _GatedTier.order = []
    _GatedTier.entered = threading.Semaphore(0)
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.008, local_disk=str(tmp_path / "d"),
                 max_local_disk_size=0.1, prefetch_policy=policy)
    sm = StorageManager(cfg, SMALL_MHA)
    keys = make_keys(48)
    objs = [make_obj(sm.allocator, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
    sm.want = [o.tensor.clone() for o in objs]  # type: ignore[attr-defined]
    with lease(objs):
        sm.put(keys, objs)
    assert sm.flush()
    sm.hot.remove(keys)
    _GatedTier.gate.clear()
    return sm


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


def _both_loaded(sm: StorageManager, first_keys: list[ChunkKey],
                 second_keys: list[ChunkKey]) -> tuple[Prefetch, Prefetch]:
    """Two prefetches, the second started while the first reads from the held lower tier (so
    it waits for that read and then shares its chunks), both run to the end."""
    first = sm.start_prefetch(first_keys)
    assert _GatedTier.entered.acquire(timeout=30)  # the first one is reading
    second = sm.start_prefetch(second_keys)
    _GatedTier.gate.set()
    assert first.result(timeout=30) == 3 and second.result(timeout=30) == len(second_keys)
    assert sorted(_GatedTier.reads.values()) == [1, 1, 1]  # the second read nothing itself
    return first, second


def test_abort_keeps_the_chunks_another_prefetch_waited_for(gated: StorageManager) -> None:
    keys = make_keys(48)
    first, second = _both_loaded(gated, keys, keys)
    first.cancel(drop=True)  # its request was aborted; the second one's still waits
    assert gated.hot.batch_contains(keys) == 3
    assert gated.stats()["prefetch_dropped_chunks"] == 0
    second.cancel()  # admitted: its load finds every chunk
    with gated.get(keys, hot_only=True) as objs:
        assert [same_bytes(o.tensor, w) for o, w in zip(objs, gated.want)] == [True] * 3


def test_abort_drops_what_no_live_prefetch_wants(gated: StorageManager) -> None:
    keys = make_keys(48)
    first, second = _both_loaded(gated, keys, keys[:2])
    first.cancel(drop=True)  # the second still wants the first two chunks, not the third
    assert gated.hot.batch_contains(keys) == 2
    assert gated.stats()["prefetch_dropped_chunks"] == 1
    second.cancel(drop=True)  # it brought nothing up itself: nothing of its own to drop
    assert gated.hot.batch_contains(keys) == 2


def test_abort_after_the_others_were_admitted_drops_everything(gated: StorageManager) -> None:
    keys = make_keys(48)
    start = gated.allocator.used_bytes
    first, second = _both_loaded(gated, keys, keys)
    second.cancel()  # admitted: no longer a live prefetch
    first.cancel(drop=True)
    assert gated.hot.batch_contains(keys) == 0
    assert gated.allocator.used_bytes == start
    assert gated.stats()["prefetch_dropped_chunks"] == 3


@pytest.fixture
def one_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StorageManager]:
    """The `gated` manager with one prefetch worker and room for one queued prefetch."""
    monkeypatch.setattr("kvtier.storage.prefetch.loads.PREFETCH_WORKERS", 1)
    monkeypatch.setattr("kvtier.storage.prefetch.loads.PREFETCH_MAX_PENDING", 1)
    sm = _gated_manager(tmp_path, monkeypatch)
    try:
        yield sm
    finally:
        _GatedTier.gate.set()
        sm.close()
        assert sm.allocator.used_bytes == 0


def _running_and_queued(sm: StorageManager, keys: list[ChunkKey]) -> tuple[Prefetch, Prefetch]:
    running = sm.start_prefetch(keys)
    assert _GatedTier.entered.acquire(timeout=30)  # the only worker is reading
    return running, sm.start_prefetch(keys)


def test_wants_end_on_cancel_refusal_or_garbage(one_worker: StorageManager) -> None:
    keys = make_keys(48)
    wanting = one_worker.prefetch_wants
    running, queued = _running_and_queued(one_worker, keys)
    refused = one_worker.start_prefetch(keys)  # the queue is full
    assert refused.done() and refused.result() == 0
    assert [wanting(k) for k in keys] == [2, 2, 2]
    _GatedTier.gate.set()
    assert running.result(timeout=30) == 3 and queued.result(timeout=30) == 3
    assert wanting(keys[0]) == 2  # done, not yet admitted: still wanted
    running.cancel()
    queued.cancel(drop=True)
    queued.cancel(drop=True)  # a second cancel releases nothing more
    assert [wanting(k) for k in keys] == [0, 0, 0]
    forgotten = one_worker.start_prefetch(keys)  # a caller that never cancels
    assert forgotten.result(timeout=30) == 3 and wanting(keys[0]) == 1
    del forgotten
    deadline = time.monotonic() + 30  # a bound on a hang: the worker lets go after finish()
    while wanting(keys[0]) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.001)
    assert wanting(keys[0]) == 0


def test_wants_of_queued_prefetches_end_at_close(one_worker: StorageManager) -> None:
    keys = make_keys(48)
    wanting = one_worker.prefetch_wants
    running, queued = _running_and_queued(one_worker, keys)
    closer = threading.Thread(target=one_worker.close)
    closer.start()
    assert queued.result(timeout=30) == 0  # cancelled by the close
    _GatedTier.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert wanting(keys[0]) == 1  # the running one is its caller's to cancel
    running.cancel()
    assert wanting(keys[0]) == 0
    assert one_worker.start_prefetch(keys).result(timeout=0) == 0  # closed: wants nothing
    assert wanting(keys[0]) == 0


def test_cancel_stops_before_the_next_window_and_keeps_what_arrived(
        gated: StorageManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvtier.storage.prefetch.handle.PREFETCH_WINDOW", 1)
    keys = make_keys(48)
    prefetch = gated.start_prefetch(keys)
    assert _GatedTier.entered.acquire(timeout=30)
    prefetch.cancel()
    _GatedTier.gate.set()
    assert prefetch.result(timeout=30) == 1
    assert gated.hot.batch_contains(keys) == 1


def test_two_clients_loads_progress_in_turn_on_a_slow_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The storage manager's loads with one worker and one-chunk windows: a second client's
    load starts before the first client's whole prompt arrived."""
    monkeypatch.setattr("kvtier.storage.prefetch.loads.PREFETCH_WORKERS", 1)
    monkeypatch.setattr("kvtier.storage.prefetch.handle.PREFETCH_WINDOW", 1)
    sm = _gated_manager(tmp_path, monkeypatch)
    try:
        other = make_keys(48, seed=7)
        objs = [make_obj(sm.allocator, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(other)]
        with lease(objs):
            sm.put(other, objs)
        _GatedTier.gate.set()
        assert sm.flush()
        sm.hot.remove(other)
        _GatedTier.gate.clear()
        first = sm.start_prefetch(make_keys(48))
        assert _GatedTier.entered.acquire(timeout=30)  # reading its first chunk, held
        second = sm.start_prefetch(other)
        _GatedTier.gate.set()
        assert first.result(timeout=30) == 3 and second.result(timeout=30) == 3
        order = _GatedTier.order
        assert order.index(other[0].key) < order.index(make_keys(48)[-1].key)
    finally:
        _GatedTier.gate.set()
        sm.close()


def test_a_tier_that_stalls_mid_load_is_given_up_at_the_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adaptive: estimates say the tier is fast, so the whole prompt is planned; the tier then
    stalls (its reads held). The request may go on at the plan's deadline, with what arrived
    (nothing), while the read is still stuck; once admitted, the load stops."""
    sm = _gated_manager(tmp_path, monkeypatch, policy="adaptive")
    try:
        tier = sm.lower_tiers[0]
        tier.speed.observe_latency(1e-4)
        tier.speed.observe_read(1 << 20, 1e-3)  # 1 GB/s
        sm.prefill.observe(4096, 4096 / 100.0, 4096)  # recompute: 100 tokens/s
        keys = make_keys(48)
        prefetch = sm.start_prefetch(keys)
        assert _GatedTier.entered.acquire(timeout=30)  # the planned read started; it stalls
        assert prefetch.deadline < prefetch.started + 48 / 100.0  # before break-even
        deadline = time.monotonic() + 30  # a bound on a hang, not a timing assertion
        while not prefetch.ready():
            assert time.monotonic() < deadline, "never admitted while the tier stalled"
            time.sleep(0.001)
        assert not prefetch.done()  # the read is still stuck
        assert sm.hot.batch_contains(keys) == 0  # what arrived: nothing
        prefetch.cancel()  # admitted: the request recomputes the rest
        _GatedTier.gate.set()
        assert prefetch.result(timeout=30) <= 3
        assert sm.stats()["adaptive_tokens_recomputed_deadline"] + \
            sm.stats()["adaptive_tokens_loaded"] == 48
    finally:
        _GatedTier.gate.set()
        sm.close()
