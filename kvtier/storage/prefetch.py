"""Background prefetch: lower-tier chunks move into the hot (CPU) tier off the serving thread.

A `Prefetch` is one request's load; a `Prefetcher` runs them on a few worker threads behind a
bounded queue, one read window at a time and round-robin, so one request's long prompt never
holds the workers while other requests wait (`loads.PrefetchLoads` does each turn's work). The
serving thread never waits here unless it asks to: it polls `ready()`, which answers per
`prefetch_policy`, or blocks in `result()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout

from kvtier.background import name_os_thread
from kvtier.config.names import WAIT_COMPLETE
from kvtier.keys import ChunkKey, KeyChain
from kvtier.metrics import RateLimitedLog
from kvtier.storage.prefetch_policy import PrefetchPolicy, prefetch_policy

__all__ = ["Prefetch", "Prefetcher", "PREFETCH_WINDOW"]

logger = logging.getLogger(__name__)

# Chunks a prefetch claims and reads at a time: one pipelined round trip to a remote tier, and
# the granularity at which a cancel takes effect.
PREFETCH_WINDOW = 64
_warn = RateLimitedLog(logger)


class Prefetch:
    """One background load of `keys` (a request's chunks, in order) into the hot tier.

    Args:
        keys: the chunks to load, in prefix order; a `KeyChain` also names the tails after
            them: once the chunks are in, the longest tail stored after them is brought up.
        policy: when `ready()` says the caller may go on (`kvtier.storage.prefetch_policy`,
            or its name): at once if it does not wait, else when the load is done or at the
            deadline: `budget_s` after the start, or what the load's plan sets with
            `set_deadline` (`adaptive`).
        budget_s: seconds until the deadline (`PrefetchPolicy.budget_s`; for
            `wait_complete`, its ceiling).
        drop: undoes the load for `cancel(drop=True)`; called at most once, after the load
            stopped (`PrefetchLoads.drop`).
    """

    def __init__(self, keys: Sequence[ChunkKey], policy: str | PrefetchPolicy = WAIT_COMPLETE,
                 budget_s: float = float("inf"), *,
                 drop: Callable[[Prefetch], None] | None = None):
        self.policy = policy if isinstance(policy, PrefetchPolicy) else prefetch_policy(policy)
        self.keys = list(keys)
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.loaded = 0  # leading chunks in the hot tier (final once done)
        self.promoted: list[ChunkKey] = []  # chunks this load brought up from a lower tier
        self.arena_before = 0  # arena bytes in use when the load started (for logs)
        # The worker's place in the load: leading chunks in the hot tier so far, and how many
        # the load brings there (None until its first turn planned it).
        self.position = 0
        self.limit: int | None = None
        # Leading chunks in the hot tier when the caller stopped wanting more (its first
        # `cancel()`): what an admitted request got; chunks after that were not its.
        self.used: int | None = None
        self.chain = keys if isinstance(keys, KeyChain) else None  # its tails
        self.hits: int | None = None  # leading chunks some tier holds, once the plan knows
        self._drop = drop
        self._release: Callable[[], object] | None = None  # see `hold`
        self._after: list[Callable[[int], object]] = []  # see `after`
        # Set by a plan made before the tier's speeds were measured: the request does not
        # wait, and the load goes on after the request was admitted (`cancel()` without
        # drop), promoting the chunks for later requests and timing the tier.
        self.background = False
        # Why the request's tokens count as recomputed if it is admitted before the plan (one
        # of `planner.REASONS`): it waited its whole budget, or had none and why.
        self.unwaited = "deadline"
        # Both under _lock, so cancel() and finish() agree on who runs the drop.
        self._drop_asked = False
        self._stopped = False  # finish() ran: the worker touches the load no more
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._cancelled = threading.Event()
        self._changed = threading.Condition()  # notified when done or the deadline moves

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def ready(self, now: float | None = None) -> bool:
        """Whether the caller may go on now, per the policy (never blocks)."""
        if not self.policy.waits or self._done.is_set():
            return True
        now = time.monotonic() if now is None else now
        if now < self.deadline:
            return False
        self.policy.at_deadline(len(self.keys), self.deadline - self.started)
        return True

    def set_deadline(self, deadline: float) -> None:
        """When `ready()` turns true for the `adaptive` policy (monotonic clock)."""
        with self._changed:
            self.deadline = deadline
            self._changed.notify_all()

    @property
    def stopping(self) -> bool:
        """Whether the load should stop: cancelled, unless it is a `background` load the
        request merely stopped waiting for (a drop stops every load)."""
        return self._cancelled.is_set() and (self._drop_asked or not self.background)

    def waiting(self, now: float) -> bool:
        """Whether a request is waiting for this load now (not cancelled, deadline ahead)."""
        return (self.policy.waits and not self._cancelled.is_set() and not self._done.is_set()
                and now < self.deadline)

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for `ready()`: the load done, or its deadline come
        (at once when the plan finds nothing worth waiting for, though the load may still
        look for a tail); returns `ready()`."""
        end = time.monotonic() + timeout
        with self._changed:
            while self.policy.waits and not self._done.is_set():
                now = time.monotonic()
                if now >= min(end, self.deadline):
                    break
                self._changed.wait(min(end, self.deadline) - now)
        return self.ready()

    def wait(self) -> bool:
        """Block as the policy says (no wait for `best_effort`); True if the load is done."""
        if self.policy.waits:
            while not self._done.is_set():
                now = time.monotonic()
                left = self.deadline - now
                if left <= 0:
                    break  # re-read above: the plan may move the deadline while we wait
                self._done.wait(min(left, 0.05))
        return self._done.is_set()

    def wait_done(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the load to end, whatever the policy; True if it
        did."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> int:
        """Leading chunks in the hot tier once the load is done; `TimeoutError` after
        `timeout` seconds."""
        if not self._done.wait(timeout):
            raise FutureTimeout(f"prefetch of {len(self.keys)} chunks still running")
        return self.loaded

    def hold(self, release: Callable[[], object]) -> None:
        """Call `release` once, when this prefetch stops wanting its chunks: at its first
        `cancel()` (at once if that already happened)."""
        with self._lock:
            if not self._cancelled.is_set():
                self._release = release
                return
        release()

    def cancel(self, *, drop: bool = False) -> None:
        """Stop loading after the chunks in flight; the request no longer wants the chunks
        (admitted: they are its to use now; or gone). What arrived stays in the hot tier,
        unless `drop`: then what this load brought up and no other live prefetch wants is
        removed once the load has stopped, so its memory goes back to the arena.

        Never blocks on the load. Any number of calls, racing `finish()` or each other, drop
        exactly once."""
        with self._lock:
            if not self._cancelled.is_set():
                self.used = self.loaded if self._stopped else self.position
            self._cancelled.set()
            release, self._release = self._release, None
            undo = drop and not self._drop_asked and self._stopped  # else finish() drops
            self._drop_asked |= drop
        if release is not None:
            release()  # first: our own want must not keep our chunks
        if undo:
            self._undo()

    def after(self, call: Callable[[int], object]) -> None:
        """Call `call(loaded)` once the load is done (worker side, before `done()`)."""
        self._after.append(call)

    def finish(self, loaded: int) -> None:
        """Mark the load done (worker side; later calls change nothing). A drop asked for
        before this has happened by the time `done()` is true."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.loaded = loaded
            undo = self._drop_asked
        try:
            for call in self._after:
                try:
                    call(loaded)
                except Exception as exc:  # bookkeeping only: never a dead worker
                    logger.warning("kvtier: after-prefetch hook failed: %r", exc)
            if undo:
                self._undo()
        finally:
            self._done.set()
            with self._changed:
                self._changed.notify_all()

    def _undo(self) -> None:
        if self._drop is None:
            return
        try:
            self._drop(self)
        except Exception as exc:  # the chunks stay for LRU eviction; never a dead worker
            logger.warning("kvtier: dropping a cancelled prefetch failed: %r", exc)


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
