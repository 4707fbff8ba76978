"""The storage manager's side of its prefetches: starting them, each turn's work, and sharing.

Prefetches of the same chunks share one read and then the chunks, by reference: a chunk being
read is waited for, not read twice, and an aborted prefetch gives back only what no live
prefetch wants.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier.backends.base import HotTier, StorageBackend
from kvtier.config.schema import PrefetchSection
from kvtier.keys import ChunkKey
from kvtier.metrics import Counters
from kvtier.storage.guard import GuardedTier
from kvtier.storage.prefetch import handle
from kvtier.storage.prefetch.handle import Prefetch
from kvtier.storage.prefetch.planner import LoadPlanner
from kvtier.storage.prefetch.policy import prefetch_policy
from kvtier.storage.prefetch.workers import Prefetcher

__all__ = ["PrefetchLoads", "longest_held"]

T = TypeVar("T", bound=StorageBackend)

logger = logging.getLogger(__name__)

PREFETCH_WORKERS = 2
PREFETCH_MAX_PENDING = 256


class PrefetchLoads:
    """The storage manager's side of its prefetches: each one's budget per `prefetch_policy`,
    worker threads that run them in turns, and sharing: concurrent prefetches of the same
    chunks share one read, then the chunks themselves. Thread-safe.

    Two tables under one lock: the chunks being read now (a prefetch that needs one waits for
    that read rather than reading it again) and, per chunk, how many live prefetches want it.
    A prefetch is live from `want` until its first `cancel()`, with or without drop (or until
    its handle is garbage). An aborted prefetch drops only the chunks it brought up from a
    lower tier itself and that no live prefetch wants, so nobody can take chunks away from
    the other requests that wait for them by sending and aborting the same prefix.

    Args:
        section: the prefetch policy and its budgets (`Config.prefetch`).
        hot: the tier loads go into.
        read: reads leading keys from the lower tiers into `hot`; returns how many arrived.
        planner: how many leading chunks of a prefetch to bring into `hot`, given how many are
            there already, and whether its tail is worth a read (`planner.LoadPlanner`).
        lower: the lower tiers now, fastest first (where a tail is looked for).
        stopped: whether the manager is closing; loads stop at their next window.
        counters: counts `prefetches`, `prefetch_dropped` (queue full) and
            `prefetch_dropped_chunks`.
        used_bytes: the arena's bytes in use, for the drop's log line.
    """

    def __init__(self, section: PrefetchSection, hot: HotTier,
                 read: Callable[[Sequence[ChunkKey]], int], planner: LoadPlanner,
                 lower: Callable[[], Sequence[GuardedTier]],
                 stopped: Callable[[], bool], counters: Counters,
                 used_bytes: Callable[[], int]):
        self._section = section
        self._policy = prefetch_policy(section.policy)
        self._hot = hot
        self._read = read
        self._planner = planner
        self._lower = lower
        self._stopped = stopped
        self._counters = counters
        self._used_bytes = used_bytes
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Event] = {}  # chunk -> set when its read ends
        self._wants: dict[str, int] = {}  # chunk -> live prefetches that want it (> 0)
        # Wants that ended, applied under _lock by its next holder: a release may come from
        # the garbage collector, at any point of any thread, even one that holds _lock.
        self._ended: deque[tuple[str, ...]] = deque()
        self._workers = Prefetcher(self.step, workers=PREFETCH_WORKERS,
                                   max_pending=PREFETCH_MAX_PENDING,
                                   on_dropped=lambda: counters.inc("prefetch_dropped"))

    def start(self, keys: Sequence[ChunkKey], *, accept: bool,
              ) -> Prefetch:
        """A prefetch of `keys` (and then its tail), queued for the workers if `accept`; else
        (or without keys) done at once with 0 chunks. Never blocks."""
        tokens = sum(k.num_tokens for k in keys)
        admission = self._planner.admission(tokens, keys)
        budget = self._policy.budget_s(self._section, tokens, admission.budget_s)
        prefetch = Prefetch(keys, self._policy, budget, drop=self.drop)
        prefetch.unwaited = admission.reason
        prefetch.arena_before = self._used_bytes()
        if not accept or not keys:
            prefetch.finish(0)
            return prefetch
        self._counters.inc("prefetches")
        self._policy.start(self._planner, prefetch, admission)
        self.want(prefetch)  # until cancelled; a refused submit cancels it
        self._workers.submit(prefetch)
        return prefetch

    def pending(self) -> int:
        """Prefetches waiting for a worker."""
        return self._workers.pending()

    def close(self, timeout: float) -> None:
        """Cancel queued prefetches; running ones stop at their next window (`timeout`)."""
        self._workers.close(timeout)

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

    def step(self, prefetch: Prefetch) -> int | None:
        """One turn of a prefetch's work (worker thread): plan it on its first turn, then read
        one window of its chunks into the hot tier, or wait for chunks another prefetch is
        reading; after the last chunk, its tail. Returns the leading chunks now in the hot
        tier once the load is over, None while there is more to do."""
        n = self._chunks_step(prefetch)
        if n is not None and prefetch.chain is not None and not prefetch.cancelled \
                and not self._stopped():
            self._tail(prefetch, n)
        return n

    def _chunks_step(self, prefetch: Prefetch) -> int | None:
        keys = prefetch.keys
        if prefetch.limit is None:
            prefetch.position = self._hot.batch_contains(keys)
            prefetch.limit = self._policy.plan(self._planner, prefetch, prefetch.position)
        n, limit = prefetch.position, prefetch.limit
        if n >= limit or prefetch.stopping or self._stopped():
            return n
        mine, busy = self._claim(keys[:limit], n)
        if busy is not None:  # another prefetch is reading this chunk: wait, then look
            busy.wait()
            more = self._hot.batch_contains(keys[n:limit])
            prefetch.position += more
            return None if more else prefetch.position
        try:
            got = self._read(mine)
        finally:
            self._unclaim(mine)
        prefetch.promoted.extend(mine[:got])  # brought up here (or raced in by a put)
        prefetch.position += got
        return None if got == len(mine) and prefetch.position < limit else prefetch.position

    def _tail(self, prefetch: Prefetch, n: int) -> None:
        """Bring the longest tail stored after `prefetch`'s first `n` chunks into the hot tier,
        unless the hot tier has it or the plan says it is not worth a read."""
        assert prefetch.chain is not None
        tails = prefetch.chain.tails(n)
        best, _ = longest_held(tails, [self._hot])
        best, tier = longest_held(tails[:best], self._lower())
        if tier is None:
            return
        if not self._policy.tail_worth(self._planner, prefetch, n, tier, tails[best]):
            return
        if self._read([tails[best]]):
            prefetch.promoted.append(tails[best])
            self._counters.inc("tails_prefetched")

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
            for key in keys[n:n + handle.PREFETCH_WINDOW]:
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


def longest_held(tails: Sequence[ChunkKey], tiers: Sequence[T]) -> tuple[int, T | None]:
    """The index of the first (longest) of `tails` any of `tiers` holds (`len(tails)` if
    none), and the first tier holding it; each tier is asked only for the longer ones."""
    best, holder = len(tails), None
    for tier in tiers:
        if not best:
            break
        i = tier.first_held(tails[:best])
        if i >= 0:
            best, holder = i, tier
    return best, holder
