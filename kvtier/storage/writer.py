"""Background writes to one lower tier: a bounded queue and one worker thread.

The serving thread never waits on a lower tier: `submit` either queues a chunk or drops it
(counted). The worker keeps the prefix invariant: a chunk is written only when its predecessor
is reachable (written by this worker, already in the tier, or per `reachable`), so a lower tier
never holds a chunk that `retrieve` could not get to.

Where the engine computes on the CPU (`kvtier.background.ENGINE` enabled), the worker also
yields to it. A write that lands during a forward pass costs that pass more than the write's
own CPU time: the pass's compute threads wait at their barriers for the core the write took.
So while batches run, queued writes are held (they wait for the engine to go quiet) until the
oldest has waited `HOLD_S` or `HOLD_SHARE` of the queue is waiting; from then on the worker
writes `BUSY_SHARE` of its time, and at `URGENT_SHARE` of the queue (or when closing) at once,
so nothing is dropped for the holding. It writes a few chunks per call, so a write begun in a
quiet moment ends soon after the next batch starts.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.backends.base import StorageBackend
from kvtier.background import (
    BUSY_SHARE,
    ENGINE,
    HOLD_S,
    HOLD_SHARE,
    URGENT_SHARE,
    EngineActivity,
    lower_priority,
)
from kvtier.keys import ChunkKey, stub_key
from kvtier.memory import MemoryObj
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage.backlog import CANCELLED, DROPPED, FAILED, LOSS_REASONS, LOST, ORPHANED
from kvtier.storage.watch import TierWatch

__all__ = ["TierWriter"]

logger = logging.getLogger(__name__)
_RECENT = 65536  # how many written keys to remember for the predecessor check
_BATCH = 16  # chunks per backend call
# Beside a CPU engine: a write, once begun, runs to its end, so keep each one short enough
# that a batch starting in the meantime waits for little (a chunk is a few MB).
_BATCH_CPU_ENGINE = 2


class TierWriter:
    """Owns the references of queued objects and releases each exactly once: when written,
    dropped, or discarded at close/cancel. Nothing is queued once `close`/`cancel` began, so
    nothing queued is left behind.

    Every chunk handed to `submit` is counted once when settled: `writes`, `write_present`
    (the tier held it), or lost, under its reason and `writes_lost` (`kvtier.storage.backlog`).
    """

    def __init__(
        self,
        backend: StorageBackend,
        capacity: int,
        counters: Counters,
        warn: RateLimitedLog,
        reachable: Callable[[str], bool] = lambda key: False,
        engine: EngineActivity = ENGINE,
        busy_share: float = BUSY_SHARE,
        watch: TierWatch | None = None,
    ):
        self.backend = backend
        self._watch = watch or TierWatch()
        self._engine = engine
        self._busy_share = busy_share
        self._last_write = (0.0, 0.0)  # (its duration, its end): see `_yield_to_engine`
        # (key, object, when it was queued); None: the stop marker.
        self._queue: queue.Queue[tuple[ChunkKey, MemoryObj, float] | None] = \
            queue.Queue(capacity)
        self._hold_from = max(1, int(capacity * HOLD_SHARE))
        self._urgent_from = max(1, int(capacity * URGENT_SHARE))
        self._counters = counters
        counters.declare(*(f"{backend.name}.{event}" for event in (
            "writes", "write_errors", "write_present", "write_deferrals", LOST,
            *LOSS_REASONS)))
        self._warn = warn
        self._reachable = reachable
        self._recent: OrderedDict[str, None] = OrderedDict()
        # Guards _closed, and is held while submit queues: an item is either queued before the
        # stop marker (then written or discarded) or refused; never queued behind it.
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvtier-writer-{backend.name}",
                                         daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        """Queue `keys` in order (takes one new reference per queued object); returns how many
        were queued. Stops at the first chunk that does not fit: later ones would be orphans."""
        name = self.backend.name
        with self._lock:
            if self._closed:  # a caller holding the writer list from before a detach/close
                self._lose(len(keys), CANCELLED)
                return 0
            now = time.monotonic()
            for i, (key, obj) in enumerate(zip(keys, objs, strict=True)):
                obj.retain()
                try:
                    self._queue.put_nowait((key, obj, now))
                except queue.Full:
                    obj.release()
                    self._lose(len(keys) - i, DROPPED)
                    self._warn.warning(f"queue-{name}", "kvtier: %s write queue full; "
                                       "dropping writes (the tier is slower than the store "
                                       "rate)", name)
                    return i
            return len(keys)

    def pending(self) -> int:
        """Chunks handed over and not settled yet: queued, or in the write running now (a
        stop ending now loses them). Counts the worker's stop marker while it waits."""
        return self._queue.unfinished_tasks

    def drain(self, timeout: float) -> bool:
        """Wait until everything queued so far is written; False if `timeout` ran out."""
        deadline = time.monotonic() + timeout
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                done.wait(remaining)
        return True

    def close(self, timeout: float) -> None:
        """Write what is queued (up to `timeout` seconds), then stop the worker. What is
        still queued then is released unwritten. Idempotent."""
        if not self._shut():
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        stuck = self._thread.is_alive()
        if stuck:
            logger.warning("kvtier: %s writer did not drain within %.1fs; %d writes lost",
                           self.backend.name, timeout, self._queue.qsize())
        self._lose(self._discard_queued(), CANCELLED)
        if stuck:
            self._stop_marker()  # the first one may have gone with the rest

    def cancel(self, timeout: float) -> None:
        """Drop what is queued (counted), let the write in progress finish, stop the worker.
        Idempotent (also after `close`)."""
        if not self._shut():
            return
        self._lose(self._discard_queued(), CANCELLED)
        self._stop_marker()
        self._thread.join(timeout)

    def _shut(self) -> bool:
        """Refuse submits from now on; False if that had already happened."""
        with self._lock:
            first = not self._closed
            self._closed = True
            return first

    def _stop_marker(self) -> None:
        """Queue the worker's stop; only after `_shut` and `_discard_queued`, so there is room
        (nobody else adds any more)."""
        self._queue.put_nowait(None)

    def _discard_queued(self) -> int:
        n = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return n
            self._queue.task_done()
            if item is not None:
                item[1].release()
                n += 1

    def _run(self) -> None:
        lower_priority()  # writes are background work: serving threads go first
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            self._yield_to_engine(queued_at=item[2])
            batch = [item[:2]]
            stop = False
            size = _BATCH_CPU_ENGINE if self._engine.enabled else _BATCH
            while len(batch) < size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.task_done()
                    stop = True
                    break
                batch.append(nxt[:2])
            start = time.monotonic()
            self._write(batch)
            end = time.monotonic()
            self._last_write = (end - start, end)
            for _ in batch:
                self._queue.task_done()
            if stop:
                return

    def _yield_to_engine(self, queued_at: float) -> None:
        """Before a write, while a CPU engine is busy (see the module doc): hold it until the
        engine goes quiet, the backlog reaches `HOLD_SHARE` of the queue or the oldest queued
        write (queued at `queued_at`) has waited `HOLD_S`; then pace it to `busy_share` of the
        time; never once `URGENT_SHARE` of the queue waits, nor once closing."""
        engine = self._engine
        if not engine.busy():
            return
        self._counters.inc(f"{self.backend.name}.write_deferrals")

        def urgent() -> bool:
            return self._closed or self._queue.qsize() >= self._urgent_from

        engine.wait_quiet(queued_at + HOLD_S - time.monotonic(),
                          lambda: urgent() or self._queue.qsize() >= self._hold_from)
        if not engine.busy() or urgent():
            return
        took, ended = self._last_write
        engine.wait_quiet(took / self._busy_share - took - (time.monotonic() - ended), urgent)

    def _write(self, batch: list[tuple[ChunkKey, MemoryObj]]) -> None:
        name = self.backend.name
        settled = 0  # chunks of `batch` written, held already, or counted as lost
        try:
            rest = self._not_held(batch)
            settled = len(batch) - len(rest)
            keys, objs = self._orderly(rest)
            self._lose(len(rest) - len(keys), ORPHANED)
            settled += len(rest) - len(keys)
            if keys:
                # A guarded tier answers a failure (error, timeout, down) with fewer written:
                # the shortfall is lost, counted below (the tier's own warning says why).
                written = self.backend.batch_put(keys, objs)
                self._counters.inc(f"{name}.writes", written)
                settled += written
                for key in keys[:written]:
                    self._remember(key.key)
                self._watch.stored(name, keys[:written])
                if written < len(keys):
                    self._warn.warning(f"short-{name}", "kvtier: %s took %d of %d writes; the "
                                       "rest are lost (see the tier's warnings)", name,
                                       written, len(keys))
        except Exception as exc:  # never kill the writer (tier failures are already misses)
            self._counters.inc(f"{name}.write_errors", len(batch) - settled)
            self._warn.warning(f"write-{name}", "kvtier: %s write failed: %r", name, exc)
        finally:
            self._lose(len(batch) - settled, FAILED)
            for _, obj in batch:
                obj.release()

    def _lose(self, n: int, reason: str) -> None:
        """Count `n` handed chunks that will never be written, under `reason` and `LOST`."""
        if n:
            self._counters.inc(f"{self.backend.name}.{reason}", n)
            self._counters.inc(f"{self.backend.name}.{LOST}", n)

    def _not_held(
        self, batch: list[tuple[ChunkKey, MemoryObj]]
    ) -> list[tuple[ChunkKey, MemoryObj]]:
        """`batch` without its leading chunks the tier already holds: stores only ask the CPU
        tier what is cached, so a prefix the CPU tier evicted comes back here (one metadata
        round trip per batch, on this thread, instead of a rewrite)."""
        held = self.backend.batch_contains([key for key, _ in batch])
        if held:
            self._counters.inc(f"{self.backend.name}.write_present", held)
            for key, _ in batch[:held]:
                self._remember(key.key)  # their successors' predecessor check passes
        return batch[held:]

    def _orderly(
        self, batch: list[tuple[ChunkKey, MemoryObj]]
    ) -> tuple[list[ChunkKey], list[MemoryObj]]:
        """The chunks of `batch` whose predecessor is reachable (checked in order); the
        caller counts the others."""
        keys: list[ChunkKey] = []
        objs: list[MemoryObj] = []
        ok: set[str] = set()
        for key, obj in batch:
            prev = key.prev
            if prev is None or prev in ok or prev in self._recent or self._reachable(prev) \
                    or self.backend.batch_contains([stub_key(prev)]) == 1:
                keys.append(key)
                objs.append(obj)
                ok.add(key.key)
        return keys, objs

    def _remember(self, key: str) -> None:
        self._recent[key] = None
        self._recent.move_to_end(key)
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
