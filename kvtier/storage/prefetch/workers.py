"""The prefetch workers: a few threads that run loads in turns, one read window at a time.

A `Prefetcher` runs prefetches behind a bounded queue, round-robin, so one request's long prompt
never holds the workers while other requests wait (`loads.PrefetchLoads` does each turn's work).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvtier.background import name_os_thread
from kvtier.storage.prefetch.handle import Prefetch

__all__ = ["Prefetcher"]

logger = logging.getLogger(__name__)


class Prefetcher:
    """Runs prefetches on `workers` threads; at most `max_pending` wait for a thread.

    Loads take turns: a worker runs one step of a prefetch (one read window) and puts it back
    at the tail unless it is done, so concurrent requests all progress, each at its share of
    the tiers. A load some request waits for goes before the others (background loads: their
    request was admitted, or never waited), and background loads never hold the last worker
    (with more than one), so a waiting request never queues behind a slow tier's promotion.

    Args:
        step: does one turn of a prefetch's work on a worker thread: returns the leading
            chunks now in the hot tier once the load is over, None to be called again after the
            others had their turn. It should stop early once `Prefetch.cancelled`.
        on_dropped: called when a prefetch is refused because the queue is full.
    """

    def __init__(self, step: Callable[[Prefetch], int | None], *, workers: int = 2,
                 max_pending: int = 256, on_dropped: Callable[[], None] | None = None):
        if workers < 1 or max_pending < 1:
            raise ValueError(f"workers and max_pending must be >= 1, got {workers}, "
                             f"{max_pending}")
        self._step = step
        self._on_dropped = on_dropped
        self._max_pending = max_pending
        self._workers = workers
        self._background = 0  # workers running a step of a load no request waits for
        self._queue: deque[Prefetch] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"kvtier-prefetch-{i}",
                                          daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, prefetch: Prefetch) -> bool:
        """Queue `prefetch`; False (and the prefetch cancelled and finished with 0 chunks)
        when the queue is full or the prefetcher closed. Never blocks."""
        with self._cond:
            if not self._closed and len(self._queue) < self._max_pending:
                self._queue.append(prefetch)
                self._cond.notify()
                return True
        prefetch.cancel()  # it will load nothing: it wants nothing either
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
        name_os_thread()
        while True:
            with self._cond:
                taken = self._take_locked()
                if taken is None:
                    return
                prefetch, background = taken
                del taken  # only `prefetch` holds the handle, and it is let go below
                self._background += background
            try:
                loaded = prefetch.position if prefetch.stopping else self._step(prefetch)
            except Exception as exc:  # a failed prefetch is a miss, never a dead worker
                logger.warning("kvtier: prefetch failed: %r", exc)
                loaded = prefetch.position
            finally:
                if background:
                    with self._cond:
                        self._background -= 1
                        self._cond.notify_all()
            if loaded is not None or not self._requeue(prefetch):
                prefetch.finish(prefetch.position if loaded is None else loaded)
            del prefetch  # idle workers hold no handle: one its caller dropped is garbage

    def _take_locked(self) -> tuple[Prefetch, bool] | None:
        """The next step to run (waiting loads first) and whether it is a background one;
        None once closed and empty. Waits on the condition (held) while there is none."""
        while True:
            if not self._queue and self._closed:
                return None
            now = time.monotonic()
            for i, prefetch in enumerate(self._queue):
                if prefetch.waiting(now):
                    del self._queue[i]
                    return prefetch, False
            if self._queue and (self._background < self._workers - 1 or self._workers == 1
                                or self._closed):
                return self._queue.popleft(), True
            self._cond.wait()

    def _requeue(self, prefetch: Prefetch) -> bool:
        """Put an unfinished prefetch back at the tail; False once closing."""
        with self._cond:
            if self._closed:
                return False
            self._queue.append(prefetch)
            self._cond.notify()
            return True
