"""Background prefetch: lower-tier chunks move into the hot (CPU) tier off the serving thread.

A `Prefetch` is one request's load; a `Prefetcher` runs them on a few worker threads behind a
bounded queue; `PrefetchLoads` is the storage manager's side of them: prefetches of the same
chunks share one read and then the chunks, by reference. The serving thread never waits here
unless it asks to: it polls `ready()`, which answers per `prefetch_policy`, or blocks in
`result()`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout

from kvtier.backends.base import HotTier
from kvtier.keys import ChunkKey
from kvtier.metrics import Counters

__all__ = ["Prefetch", "Prefetcher", "PrefetchLoads", "PREFETCH_POLICIES"]

logger = logging.getLogger(__name__)

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# Chunks a prefetch claims and reads at a time: one pipelined round trip to a remote tier, and
# the granularity at which a cancel takes effect.
PREFETCH_WINDOW = 64


class Prefetch:
    """One background load of `keys` (a request's chunks, in order) into the hot tier.

    Args:
        keys: the chunks to load, in prefix order.
        policy: when `ready()` says the caller may go on: `best_effort` at once,
            `wait_complete` when the load is done, `timeout` when done or `budget_s` passed.
        budget_s: the `timeout` policy's budget in seconds.
        drop: undoes the load for `cancel(drop=True)`; called at most once, after the load
            stopped (`PrefetchLoads.drop`).
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
        self.promoted: list[ChunkKey] = []  # chunks this load brought up from a lower tier
        self.arena_before = 0  # arena bytes in use when the load started (for logs)
        self._drop = drop
        self._release: Callable[[], object] | None = None  # see `hold`
        # Both under _lock, so cancel() and finish() agree on who runs the drop.
        self._drop_asked = False
        self._stopped = False  # finish() ran: the worker touches the load no more
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
            self._cancelled.set()
            release, self._release = self._release, None
            undo = drop and not self._drop_asked and self._stopped  # else finish() drops
            self._drop_asked |= drop
        if release is not None:
            release()  # first: our own want must not keep our chunks
        if undo:
            self._undo()

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
            if undo:
                self._undo()
        finally:
            self._done.set()

    def _undo(self) -> None:
        if self._drop is None:
            return
        try:
            self._drop(self)
        except Exception as exc:  # the chunks stay for LRU eviction; never a dead worker
            logger.warning("kvtier: dropping a cancelled prefetch failed: %r", exc)


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
            del prefetch  # idle workers hold no handle: one its caller dropped is garbage


class PrefetchLoads:
    """The storage manager's side of its prefetches: concurrent prefetches of the same chunks
    share one read, then the chunks themselves. Thread-safe.

    Two tables under one lock: the chunks being read now (a prefetch that needs one waits for
    that read rather than reading it again) and, per chunk, how many live prefetches want it.
    A prefetch is live from `want` until its first `cancel()`, with or without drop (or until
    its handle is garbage). An aborted prefetch drops only the chunks it brought up from a
    lower tier itself and that no live prefetch wants, so nobody can take chunks away from
    the other requests that wait for them by sending and aborting the same prefix.

    Args:
        hot: the tier loads go into.
        read: reads leading keys from the lower tiers into `hot`; returns how many arrived.
        stopped: whether the manager is closing; loads stop at their next window.
        counters: counts `prefetch_dropped_chunks`.
        used_bytes: the arena's bytes in use, for the drop's log line.
    """

    def __init__(self, hot: HotTier, read: Callable[[Sequence[ChunkKey]], int],
                 stopped: Callable[[], bool], counters: Counters,
                 used_bytes: Callable[[], int]):
        self._hot = hot
        self._read = read
        self._stopped = stopped
        self._counters = counters
        self._used_bytes = used_bytes
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Event] = {}  # chunk -> set when its read ends
        self._wants: dict[str, int] = {}  # chunk -> live prefetches that want it (> 0)
        # Wants that ended, applied under _lock by its next holder: a release may come from
        # the garbage collector, at any point of any thread, even one that holds _lock.
        self._ended: deque[tuple[str, ...]] = deque()

    def want(self, prefetch: Prefetch) -> None:
        """Count `prefetch` as wanting its chunks until it is cancelled (or garbage)."""
        names = tuple(dict.fromkeys(k.key for k in prefetch.keys))
        with self._lock:
            self._settle_locked()
            for name in names:
                self._wants[name] = self._wants.get(name, 0) + 1
        release = weakref.finalize(prefetch, self._ended.append, names)  # runs at most once
        release.atexit = False
        prefetch.hold(release)

    def wanting(self, key: ChunkKey) -> int:
        """How many live prefetches want `key`."""
        with self._lock:
            self._settle_locked()
            return self._wants.get(key.key, 0)

    def load(self, prefetch: Prefetch) -> int:
        """A prefetch's work (worker thread): load its chunks into the hot tier, window by
        window, waiting for chunks another prefetch is reading; returns the leading chunks
        now in the hot tier."""
        keys = prefetch.keys
        n = self._hot.batch_contains(keys)
        while n < len(keys) and not prefetch.cancelled and not self._stopped():
            mine, busy = self._claim(keys, n)
            if busy is not None:  # another prefetch is reading this chunk: wait, then look
                busy.wait()
                more = self._hot.batch_contains(keys[n:])
                if not more:
                    break
                n += more
                continue
            try:
                got = self._read(mine)
            finally:
                self._unclaim(mine)
            prefetch.promoted.extend(mine[:got])  # brought up here (or raced in by a put)
            n += got
            if got < len(mine):
                break
        return n

    def drop(self, prefetch: Prefetch) -> None:
        """Remove from the hot tier what `prefetch` brought up and no live prefetch wants,
        deepest chunk first (the `Prefetch` drop hook)."""
        promoted, prefetch.promoted = prefetch.promoted, []
        with self._lock:
            self._settle_locked()
            # Decided and removed under the lock: a prefetch that starts meanwhile either
            # counts as wanting first (the chunk stays) or looks after it went (and reads it).
            unwanted = [k for k in reversed(promoted) if k.key not in self._wants]
            removed = self._hot.remove(unwanted) if unwanted else 0
        self._counters.inc("prefetch_dropped_chunks", removed)
        logger.info("kvtier: dropped %d of the %d chunks a cancelled prefetch brought up (other "
                    "prefetches want the rest, or they were gone); arena holds %d bytes (%d "
                    "when it started)",
                    removed, len(promoted), self._used_bytes(), prefetch.arena_before)

    def _claim(self, keys: list[ChunkKey], n: int,
               ) -> tuple[list[ChunkKey], threading.Event | None]:
        """Claim the next window from `keys[n]` for reading, up to the first chunk another
        prefetch is reading; or, if `keys[n]` is one, that read's event (and no claim)."""
        with self._lock:
            busy = self._inflight.get(keys[n].key)
            if busy is not None:
                return [], busy
            mine = []
            for key in keys[n:n + PREFETCH_WINDOW]:
                if key.key in self._inflight:
                    break
                mine.append(key)
            done = threading.Event()
            for key in mine:
                self._inflight[key.key] = done
            return mine, None

    def _unclaim(self, mine: list[ChunkKey]) -> None:
        with self._lock:
            done = self._inflight[mine[0].key]
            for key in mine:
                del self._inflight[key.key]
        done.set()

    def _settle_locked(self) -> None:
        while self._ended:
            for name in self._ended.popleft():
                left = self._wants[name] - 1
                if left:
                    self._wants[name] = left
                else:
                    del self._wants[name]
