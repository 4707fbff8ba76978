"""The serving path's reads over the tiers: leading hits of a prefix leased (`get`) or streamed
chunk by chunk as they arrive (`stream`), lower-tier hits promoted into the CPU tier as they
pass, what the tiers hold looked up without moving data (`contains`, `find_tail`), and each
lower tier told what was served (`used`). `StorageManager` holds one and delegates its reads to
it; the tiers, the write policy and the gate stay the manager's.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing, contextmanager

from kvtier.backends import StorageBackend
from kvtier.backends.base import HotTier
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj, lease
from kvtier.metrics import Counters
from kvtier.storage.guard import GuardedTier
from kvtier.storage.origins import Origins
from kvtier.storage.prefetch.loads import longest_held
from kvtier.storage.watch import TierWatch
from kvtier.storage.write_policy import WritePolicy
from kvtier.storage.writer import TierWriter

__all__ = ["TierReads"]


class TierReads:
    """Reads leading hits from `hot` and then the lower tiers (`lower()`: the attached ones
    now, fastest first), telling `policy` of every hit (with `writers()`), counting hits per
    tier in `counters`, noting promotions in `origins` and `watch`; nothing is read once
    `closed()` (the manager's gate) says so."""

    def __init__(self, hot: HotTier, lower: Callable[[], Sequence[GuardedTier]],
                 policy: WritePolicy, writers: Callable[[], list[TierWriter]],
                 counters: Counters, origins: Origins, watch: TierWatch,
                 closed: Callable[[], bool]):
        self._hot = hot
        self._lower = lower
        self._policy = policy
        self._writers = writers
        self._counters = counters
        self._origins = origins
        self._watch = watch
        self._closed = closed

    def tiers(self) -> list[StorageBackend]:
        """The attached tiers, fastest first (a snapshot)."""
        return [self._hot, *self._lower()]

    @contextmanager
    def get(self, keys: Sequence[ChunkKey], *, hot_only: bool = False,
            ) -> Iterator[list[MemoryObj]]:
        """Lease the objects of the leading hits of `keys` for the duration of the block.

        Walks the tiers in order (only the CPU tier with `hot_only`), promotes lower-tier hits
        into the CPU tier, and stops at the first chunk no tier has.
        """
        objs: list[MemoryObj] = []
        with lease(objs):  # what arrived is released, even if a read fails midway
            if hot_only:  # in memory: one call, not a stream of reads
                objs += self.hot_hits(keys)
            else:
                with closing(self.stream(keys)) as chunks:
                    objs.extend(chunks)
            yield objs

    def hot_hits(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """The CPU tier's objects for the leading hits of `keys` (the caller owns them)."""
        if self._closed():
            return []
        objs = self._hot.batch_get(keys)
        for key, obj in zip(keys, objs):
            self._policy.on_hit(key, obj, self._writers())
        if objs:
            self._counters.inc(f"{self._hot.name}.hit_chunks", len(objs))
            self.used(keys[:len(objs)])
        return objs

    def stream(self, keys: Sequence[ChunkKey], *, hot_only: bool = False,
               ) -> Generator[MemoryObj, None, None]:
        """The objects of the leading hits of `keys`, each yielded as soon as it arrived, so
        the caller's copy of one chunk overlaps the reads of the next ones.

        The caller owns one reference to each yielded object. Close the generator (or run it
        to the end) to stop the reads in flight.
        """
        n = 0
        tiers = [self._hot] if hot_only else self.tiers()
        try:
            while n < len(keys) and not self._closed():
                got = 0
                for tier in tiers:
                    with closing(tier.iter_get(keys[n:])) as objs:
                        for obj in objs:
                            if tier is not self._hot:
                                self._hot.batch_put([keys[n]], [obj])  # promote
                                self._origins.promoted(keys[n], tier.name)
                                self._watch.stored(self._hot.name, keys[n:n + 1])
                            self._policy.on_hit(keys[n], obj, self._writers())
                            self._counters.inc(f"{tier.name}.hit_chunks")
                            got += 1
                            n += 1
                            yield obj
                    if got:
                        break
                if not got:
                    break
        finally:
            self.used(keys[:n])

    def contains(self, keys: Sequence[ChunkKey], *, hot_only: bool = False) -> int:
        """How many leading `keys` some tier (only the CPU tier with `hot_only`) holds; no
        data moves."""
        if hot_only:
            return self._hot.batch_contains(keys)
        n = 0
        while n < len(keys) and not self._closed():
            for tier in self.tiers():
                got = tier.batch_contains(keys[n:])
                if got:
                    n += got
                    break
            else:
                break
        return n

    def find_tail(self, tails: Sequence[ChunkKey], *, hot_only: bool = False,
                  ) -> ChunkKey | None:
        """The longest of `tails` (one prefix's candidate tails, longest first) some tier
        (only the CPU tier with `hot_only`) holds; each tier is asked only for tails longer
        than what a faster tier has. No data moves."""
        best, _ = longest_held(tails, [self._hot] if hot_only else self.tiers())
        return tails[best] if best < len(tails) else None

    def load_lower(self, keys: Sequence[ChunkKey]) -> int:
        """Read leading `keys` from the lower tiers into the CPU tier; returns how many."""
        n = 0
        with closing(self.stream(keys)) as objs:
            for obj in objs:
                obj.release()  # the CPU tier keeps its own reference
                n += 1
        return n

    def used(self, keys: Sequence[ChunkKey]) -> None:
        """Prefix `keys` was just served: each lower tier notes the use (`touch`, no I/O), so
        none evicts what the tiers above serve and then refuses its extensions as orphans.
        The whole prefix once per get: its first chunk is each tier's newest, so a prefix is
        still evicted from its end whichever tier served which part."""
        if keys:
            for tier in self._lower():
                tier.touch(keys)
