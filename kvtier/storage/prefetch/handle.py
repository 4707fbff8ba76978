"""A prefetch's handle: one request's load of lower-tier chunks into the hot (CPU) tier.

The serving thread never waits here unless it asks to: it polls `ready()`, which answers as the
prefetch's policy admits (`policy.py`), or blocks in `wait()` / `result()`. The worker side
(`workers.Prefetcher`, `loads.PrefetchLoads`) moves `position` and calls `finish()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout

from kvtier.keys import ChunkKey, KeyChain

__all__ = ["Prefetch", "Waiting", "PREFETCH_WINDOW"]

logger = logging.getLogger(__name__)

# Chunks a prefetch claims and reads at a time: one pipelined round trip to a remote tier, and
# the granularity at which a cancel takes effect.
PREFETCH_WINDOW = 64


class Waiting:
    """When a caller waiting for a prefetch may go on: the base of every prefetch policy
    (`policy.PrefetchPolicy`), and on its own a wait for the load, up to its deadline."""

    def admit(self, prefetch: Prefetch, now: float) -> bool:
        """Whether the caller waiting for `prefetch` may go on at `now` (the load unfinished;
        called until it is done). Must not block."""
        return now >= prefetch.deadline

    def went_on(self, prefetch: Prefetch, waited_s: float) -> bool:
        """The caller went on after `waited_s` with the load unfinished (once per prefetch);
        returns whether that counts as a timeout (`prefetch_timeouts`)."""
        return False


UNTIL_DEADLINE = Waiting()


class Prefetch:
    """One background load of `keys` (a request's chunks, in order) into the hot tier.

    Args:
        keys: the chunks to load, in prefix order; a `KeyChain` also names the tails after
            them: once the chunks are in, the longest tail stored after them is brought up.
        policy: when `ready()` says the caller may go on: when the load is done or the policy
            admits it (`policy.PrefetchPolicy`; by default at the deadline: `budget_s` after
            the start, or what the load's plan sets with `set_deadline`).
        budget_s: seconds until the deadline (`PrefetchPolicy.budget_s`; for
            `wait_complete`, its ceiling).
        drop: undoes the load for `cancel(drop=True)`; called at most once, after the load
            stopped (`PrefetchLoads.drop`).
    """

    def __init__(self, keys: Sequence[ChunkKey], policy: Waiting = UNTIL_DEADLINE,
                 budget_s: float = float("inf"), *,
                 drop: Callable[[Prefetch], None] | None = None):
        self.policy = policy
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
        self.timed_out: bool | None = None  # the policy's verdict once the caller went on early
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
        """Whether the caller may go on now: the load done, or the policy admits it (never
        blocks)."""
        if self._done.is_set():
            return True
        now = time.monotonic() if now is None else now
        if not self.policy.admit(self, now):
            return False
        if self.timed_out is None:
            self.timed_out = self.policy.went_on(self, now - self.started)
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
        """Whether a request is waiting for this load now (not cancelled, not admitted)."""
        return (not self._cancelled.is_set() and not self._done.is_set()
                and not self.policy.admit(self, now))

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for `ready()`: the load done, or the policy admitting
        the caller (at once when the plan finds nothing worth waiting for, though the load
        may still look for a tail); returns `ready()`."""
        end = time.monotonic() + timeout
        with self._changed:
            while not self._done.is_set():
                now = time.monotonic()
                if now >= end or self.policy.admit(self, now):
                    break
                # Woken when the load ends or the plan moves the deadline; a policy that
                # admits on something else is looked at again within 50 ms.
                self._changed.wait(min(end - now, 0.05, max(self.deadline - now, 0.001)))
        return self.ready()

    def wait(self) -> bool:
        """Block until `ready()` (at once for a policy that never waits); True if the load is
        done."""
        self.wait_ready(float("inf"))
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
