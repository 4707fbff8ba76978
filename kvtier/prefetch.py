"""Background prefetch: lower-tier chunks move into the hot (CPU) tier off the serving thread.

A `Prefetch` is one request's load; a `Prefetcher` runs them on a few worker threads behind a
bounded queue. The serving thread never waits here unless it asks to: it polls `ready()`, which
answers per `prefetch_policy`, or blocks in `result()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout

from kvtier.keys import ChunkKey

__all__ = ["Prefetch", "Prefetcher", "PREFETCH_POLICIES"]

logger = logging.getLogger(__name__)

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


class Prefetch:
    """One background load of `keys` (a request's chunks, in order) into the hot tier.

    Args:
        keys: the chunks to load, in prefix order.
        policy: when `ready()` says the caller may go on: `best_effort` at once,
            `wait_complete` when the load is done, `timeout` when done or `budget_s` passed.
        budget_s: the `timeout` policy's budget in seconds.
        drop: undoes the load (removes `promoted` from the hot tier) for `cancel(drop=True)`.
    """

    def __init__(self, keys: Sequence[ChunkKey], policy: str = "wait_complete",
                 budget_s: float = 0.0, *, drop: Callable[[Prefetch], None] | None = None):
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"policy must be one of {PREFETCH_POLICIES}, got {policy!r}")
        self.keys = list(keys)
        self.policy = policy
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.loaded = 0  # leading chunks in the hot tier (final once done)
        self.promoted: list[ChunkKey] = []  # chunks this load put into the hot tier
        self.arena_before = 0  # arena bytes in use when the load started (for logs)
        self._drop = drop
        self._drop_pending = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def ready(self, now: float | None = None) -> bool:
        """Whether the caller may go on now, per the policy (never blocks)."""
        if self.policy == "best_effort" or self._done.is_set():
            return True
        if self.policy == "timeout":
            return (time.monotonic() if now is None else now) >= self.deadline
        return False

    def wait(self) -> bool:
        """Block as the policy says (no wait for `best_effort`); True if the load is done."""
        if self.policy == "wait_complete":
            self._done.wait()
        elif self.policy == "timeout":
            self._done.wait(max(0.0, self.deadline - time.monotonic()))
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> int:
        """Leading chunks in the hot tier once the load is done; `TimeoutError` after
        `timeout` seconds."""
        if not self._done.wait(timeout):
            raise FutureTimeout(f"prefetch of {len(self.keys)} chunks still running")
        return self.loaded

    def cancel(self, *, drop: bool = False) -> None:
        """Stop loading after the chunks in flight. What arrived stays in the hot tier, unless
        `drop`: then it is removed once the load has stopped (the request that wanted it is
        gone, so its memory goes back to the arena). Never blocks on the load."""
        with self._lock:
            self._cancelled.set()
            if not drop:
                return
            if not self._done.is_set():
                self._drop_pending = True  # the worker drops when it stops
                return
        self._undo()

    def finish(self, loaded: int) -> None:
        """Mark the load done (worker side)."""
        with self._lock:
            self.loaded = loaded
            self._done.set()
            drop = self._drop_pending
        if drop:
            self._undo()

    def _undo(self) -> None:
        if self._drop is not None:
            self._drop(self)


class Prefetcher:
    """Runs prefetches on `workers` threads; at most `max_pending` wait for a thread.

    Args:
        load: does one prefetch's work on a worker thread and returns the leading chunks
            now in the hot tier; it should check `Prefetch.cancelled` between chunks.
        on_dropped: called when a prefetch is refused because the queue is full.
    """

    def __init__(self, load: Callable[[Prefetch], int], *, workers: int = 2,
                 max_pending: int = 256, on_dropped: Callable[[], None] | None = None):
        if workers < 1 or max_pending < 1:
            raise ValueError(f"workers and max_pending must be >= 1, got {workers}, "
                             f"{max_pending}")
        self._load = load
        self._on_dropped = on_dropped
        self._max_pending = max_pending
        self._queue: deque[Prefetch] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"kvtier-prefetch-{i}",
                                          daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, prefetch: Prefetch) -> bool:
        """Queue `prefetch`; False (and the prefetch finished with 0 chunks) when the queue is
        full or the prefetcher closed. Never blocks."""
        with self._cond:
            if not self._closed and len(self._queue) < self._max_pending:
                self._queue.append(prefetch)
                self._cond.notify()
                return True
        prefetch.finish(0)
        if self._on_dropped is not None:
            self._on_dropped()
        return False

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self, timeout: float) -> None:
        """Cancel queued prefetches, let running ones stop at their next chunk, join."""
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for p in dropped:
            p.cancel()
            p.finish(0)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                logger.warning("kvtier: prefetch thread %s still running after %.1fs", t.name,
                               timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                prefetch = self._queue.popleft()
            loaded = 0
            try:
                if not prefetch.cancelled:
                    loaded = self._load(prefetch)
            except Exception as exc:  # a failed prefetch is a miss, never a dead worker
                logger.warning("kvtier: prefetch failed: %r", exc)
            finally:
                prefetch.finish(loaded)
