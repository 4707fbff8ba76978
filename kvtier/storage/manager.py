"""The storage manager: a hot tier and ordered lower tiers behind one batched, prefix-aware
interface.

Puts land in the hot (CPU) tier at once and reach the lower tiers in the background per the
write policy; gets walk the tiers in order and promote lower-tier hits into the hot tier. Every
tier sits behind a guard that turns its failures into counted misses (`kvtier.storage.guard`).
The reads (leading hits leased or streamed, lookups) are `TierReads`' (`kvtier.storage.reads`),
which the manager delegates to.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager

from kvtier import prometheus
from kvtier.backends import BackendContext, StorageBackend
from kvtier.config import Config
from kvtier.keys import ChunkKey, stub_key
from kvtier.memory import ALIGN, KVLayout, MemoryAllocator, MemoryObj
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage.admission import make_admission
from kvtier.storage.backlog import WriteBacklog, write_backlog
from kvtier.storage.gate import Gate
from kvtier.storage.guard import GuardedTier
from kvtier.storage.hot import new_arena, open_hot_tier
from kvtier.storage.origins import Origins
from kvtier.storage.prefetch.estimates import PrefillSpeed
from kvtier.storage.prefetch.handle import Prefetch
from kvtier.storage.prefetch.loads import PrefetchLoads
from kvtier.storage.prefetch.planner import LoadPlanner
from kvtier.storage.reads import TierReads
from kvtier.storage.records import TierRecords
from kvtier.storage.sessions import SessionPins
from kvtier.storage.tierset import TierSet, discard
from kvtier.storage.watch import TierWatch
from kvtier.storage.write_policy import make_write_policy
from kvtier.storage.writer import TierWriter

__all__ = ["StorageManager"]

logger = logging.getLogger(__name__)

COUNTERS = ("chunks_put", "cpu_evictions", "prefetches", "prefetch_dropped", "prefetch_timeouts",
            "prefetch_dropped_chunks", "tier_attached", "tier_detached", "tails_prefetched")


class StorageManager:
    """Tiers from `config.tiers`, fastest first. Thread-safe.

    Args:
        config: the effective config.
        layout: the layout of every chunk stored through this manager.
        allocator: the arena; one of `max_local_cpu_size` GB is created when omitted.
    """

    def __init__(self, config: Config, layout: KVLayout,
                 allocator: MemoryAllocator | None = None):
        self.config = config
        self.layout = layout
        self.allocator = allocator if allocator is not None else new_arena(config)
        self.counters = Counters(*COUNTERS)
        self._warn = RateLimitedLog(logger)
        self._gate = Gate()  # put/stats/start_prefetch calls: close() waits for them
        ctx = BackendContext(config, layout, self.allocator, self.counters)
        hot = open_hot_tier(ctx, self._warn)
        self.counters.declare(f"{hot.name}.hit_chunks")
        self.hot = hot
        self.origins = Origins()  # which lower tier the CPU tier's copies were read from
        self.policy = make_write_policy(config.writes, hot)
        self.admission = make_admission(config.admission_policy, self.allocator.size,
                                        layout.nbytes(config.chunk_size))
        self.watch = TierWatch()  # what each tier gains and loses, for whoever watches
        in_hot = lambda key: hot.batch_contains([stub_key(key)]) == 1  # noqa: E731
        self._set = TierSet(ctx, self._warn, in_hot if self.policy.holds_back
                            else lambda key: False, self.watch)
        try:
            self._set.open(config.tiers)
        except BaseException:
            hot.close()
            raise
        self._reads = TierReads(hot, lambda: self._set.tiers, self.policy,
                                lambda: self._set.writers, self.counters, self.origins,
                                self.watch, lambda: self._gate.closed)
        self.sessions = SessionPins(
            hot, int(config.max_session_pinned_fraction * self.allocator.size),
            config.session_ttl_secs, self.counters, arena_bytes=self.allocator.size,
            tenant_share=config.tenant_max_fraction)
        self.prefill = PrefillSpeed()  # fed by the serving engine's prefills
        self._planner = LoadPlanner(lambda: self._set.tiers, self.prefill, layout.nbytes,
                                    self.allocator.size, self.counters)
        self._loads = PrefetchLoads(config.prefetch, hot, self._reads.load_lower, self._planner,
                                    lambda: self._set.tiers, lambda: self._gate.closed,
                                    self.counters, lambda: self.allocator.used_bytes)
        self.allocator.set_evictor(self._evict)
        prometheus.register(self)
        logger.info("kvtier storage: tiers %s, write policy %s", [t.name for t in self.tiers],
                    self.policy.name)

    @property
    def tiers(self) -> list[StorageBackend]:
        """The attached tiers, fastest first (a snapshot: attach/detach publish new lists)."""
        return [self.hot, *self._set.tiers]

    @property
    def lower_tiers(self) -> list[GuardedTier]:
        """The attached lower tiers behind their guards (with measured `speed`s); a snapshot."""
        return list(self._set.tiers)

    @property
    def closed(self) -> bool:
        """Whether `close()` has started (new calls are refused from then on)."""
        return self._gate.closed

    @property
    def _writers(self) -> list[TierWriter]:
        return self._set.writers

    # -- the serving path ------------------------------------------------------------------

    def put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj], *,
            write_down: bool = True) -> None:
        """Store `objs` under `keys` (contiguous chunks, in order); with `write_down=False` in
        the CPU tier only. Never blocks on a lower tier and never takes over the caller's
        references."""
        if len(keys) != len(objs):
            raise ValueError(f"keys and objs differ in length: {len(keys)} != {len(objs)}")
        with self._gate.enter() as open_:
            if not open_ or not keys:
                return
            if self.hot.keeps_puts:
                self.hot.batch_put(keys, objs)
                self.origins.stored(keys)
                self.watch.stored(self.hot.name, keys)
            if write_down:
                self.policy.on_put(keys, objs, self._writers)
            self.counters.inc("chunks_put", len(keys))

    def write_around(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> bool:
        """Hand `objs` to the lower tiers' writers only, whatever the write policy: chunks the
        CPU tier's admission refused (`kvtier.engine.around`). False if no tier took them."""
        with self._gate.enter() as open_:
            writers = self._writers if open_ else []
            taken = [writer.submit(keys, objs) for writer in writers]  # every writer's turn
            return any(taken)

    def admit(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading `keys` (chunks the CPU tier lacks, in order) a store should add:
        the admission policy's answer, before anything is allocated (`storage.admission`)."""
        arena = self.allocator
        return self.admission.admit(keys, lambda: sum(
            -(-self.layout.nbytes(k.num_tokens) // ALIGN) * ALIGN for k in keys)
            <= arena.size - arena.used_bytes)

    def get(self, keys: Sequence[ChunkKey], *, hot_only: bool = False,
            ) -> AbstractContextManager[list[MemoryObj]]:
        """Lease the objects of the leading hits of `keys` for the duration of the block.

        Walks the tiers in order (only the CPU tier with `hot_only`), promotes lower-tier hits
        into the CPU tier, and stops at the first chunk no tier has (`TierReads.get`).
        """
        return self._reads.get(keys, hot_only=hot_only)

    def stream(self, keys: Sequence[ChunkKey], *, hot_only: bool = False,
               ) -> Generator[MemoryObj, None, None]:
        """The objects of the leading hits of `keys`, each yielded as soon as it arrived, so
        the caller's copy of one chunk overlaps the reads of the next ones.

        The caller owns one reference to each yielded object. Close the generator (or run it
        to the end) to stop the reads in flight (`TierReads.stream`).
        """
        return self._reads.stream(keys, hot_only=hot_only)

    def contains(self, keys: Sequence[ChunkKey], *, hot_only: bool = False) -> int:
        """How many leading `keys` some tier (only the CPU tier with `hot_only`) holds; no
        data moves."""
        return self._reads.contains(keys, hot_only=hot_only)

    def find_tail(self, tails: Sequence[ChunkKey], *, hot_only: bool = False,
                  ) -> ChunkKey | None:
        """The longest of `tails` (one prefix's candidate tails, longest first) some tier
        (only the CPU tier with `hot_only`) holds; each tier is asked only for tails longer
        than what a faster tier has. No data moves."""
        return self._reads.find_tail(tails, hot_only=hot_only)

    def start_prefetch(self, keys: Sequence[ChunkKey]) -> Prefetch:
        """Start loading the lower-tier chunks of `keys` into the CPU tier in the background,
        then, when `keys` is a `KeyChain`, the longest tail stored after the last of them that
        some tier has (see `KeyChain.tails`; cut the chain with `upto` to load less).

        Never blocks. The returned handle's `ready()` answers per `prefetch_policy`:
        `adaptive`: once the part of the hits that arrives sooner than it could be recomputed
        is loaded (measured tier and prefill speeds), or at that part's deadline;
        `best_effort`: at once; `wait_complete`: once loaded (at most
        `prefetch_wait_complete_max_ms`); `timeout`: once loaded or after
        `prefetch_timeout_base_ms` + `prefetch_timeout_per_token_ms` x tokens. `cancel()`
        stops the load at its next chunk. Chunks being loaded by another prefetch are waited
        for, not read twice. With `local_cpu: false` the chunks are staged in the transfer
        arena until `retrieve` delivers them (`unstage`).
        """
        with self._gate.enter() as open_:
            return self._loads.start(keys, accept=open_)

    def prefetch(self, keys: Sequence[ChunkKey]) -> Prefetch:
        """`start_prefetch`, then wait as `prefetch_policy` says (none for `best_effort`)."""
        prefetch = self.start_prefetch(keys)
        if not prefetch.wait() and prefetch.timed_out:
            self.counters.inc("prefetch_timeouts")
        return prefetch

    # -- what the serving engine tells the tiers ---------------------------------------------

    def pin_session(self, session_id: str, keys: Sequence[ChunkKey]) -> None:
        """Pin `keys` in the CPU tier as session `session_id`'s latest turn (`SessionPins`)."""
        self.sessions.pin(session_id, keys)

    def touch_session(self, session_id: str) -> None:
        """Session `session_id` is active: its idle clock restarts."""
        self.sessions.touch(session_id)

    def release_session(self, session_id: str) -> bool:
        """Unpin session `session_id`'s chunks; False if it held none."""
        return self.sessions.release(session_id)

    def unstage(self, keys: Sequence[ChunkKey]) -> None:
        """`keys` were delivered to their request: a staging tier (`local_cpu: false`) lets go
        of those no live prefetch still wants. A CPU tier keeps them (it is a cache)."""
        if self.hot.keeps_puts:
            return
        if done := [k for k in keys if not self._loads.wanting(k)]:
            self.hot.remove(done)

    def prefetch_wants(self, key: ChunkKey) -> int:
        """How many live prefetches want `key` (an aborted one drops no chunk another wants)."""
        return self._loads.wanting(key)

    # -- tiers at run time: `TierSet` holds the contracts ------------------------------------

    def attach_tier(self, name: str, config: Config | None = None) -> None:
        """Add lower tier `name` (`disk`, `redis`) while stores and loads run, built from
        `config` (default the manager's own); it serves hits at once. See `TierSet.attach`
        (and its errors: `ValueError`, `ConfigError`)."""
        self._set.attach(name, config)

    def build_tier(self, name: str, config: Config | None = None,
                   ) -> tuple[GuardedTier, TierWriter]:
        """The slow half of `attach_tier`, unpublished: hand the result to `publish_tier`,
        or `discard_tier` it; see `TierSet.build`."""
        return self._set.build(name, config)

    def publish_tier(self, tier: GuardedTier, writer: TierWriter) -> None:
        """The fast half of `attach_tier`; see `TierSet.publish`."""
        self._set.publish(tier, writer)

    discard_tier = staticmethod(discard)  # close a built tier that was never published

    def detach_tier(self, name: str, *, drain: bool = True, timeout: float | None = None,
                    wait: bool = True) -> None:
        """Remove lower tier `name` while stores and loads run, then close it, its queued
        writes written (`drain`) or dropped. See `TierSet.detach` (and its `ValueError`)."""
        self._set.detach(name, drain=drain, timeout=timeout, wait=wait)

    def tier_records(self) -> list[TierRecords]:
        """Each attached tier's own records, fastest first, for shadow verification
        (`kvtier.storage.records`): read without promotion, removed from one tier alone."""
        return [TierRecords(tier, self.watch, tier is self.hot) for tier in self.tiers]

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Delete `keys` from every tier; returns the most any one tier deleted."""
        deleted = {tier.name: tier.remove(keys) for tier in self.tiers}
        for name in deleted:
            self.watch.removed(name, [key.key for key in keys])
        return max(deleted.values(), default=0)

    def stats(self) -> dict[str, float]:
        """Manager counters plus every tier's stats as `tier.name` entries (once closing, the
        counters only: a tier is never asked once `close()` may be closing it)."""
        out: dict[str, float] = dict(self.counters.snapshot())
        with self._gate.enter() as open_:
            if open_:
                for tier in self.tiers:
                    out.update({f"{tier.name}.{k}": v for k, v in tier.stats().items()})
                out.update(self._set.stats())  # lower tiers' speeds and write queues
                out.update(self.prefill.stats())
                out.update(self.sessions.stats())
                out.update(self.admission.stats())
        out["prefetch_queue"] = self._loads.pending()
        out.update(arena_used_bytes=self.allocator.used_bytes, arena_bytes=self.allocator.size)
        return out

    def write_backlog(self) -> WriteBacklog:
        """Lower-tier writes over every tier: written, pending, lost since the start."""
        return write_backlog(self.counters, sum(w.pending() for w in self._writers))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every lower-tier write queued so far is done, `timeout` seconds in all
        (not per tier); False on timeout, with a warning naming what was left. See
        `TierSet.flush`."""
        return self._set.flush(timeout)

    def close(self) -> None:
        """Drain background writes (bounded by `blocking_timeout_secs`), then close tiers.

        Puts, prefetches and stats' tier calls are refused from the start; those already
        running are waited for (same bound), so the write policy's `on_close` sees every put
        that returned and no call reaches a closed tier. Idempotent."""
        timeout = self.config.blocking_timeout_secs
        running = self._gate.close(timeout)
        if running is None:
            return
        if running:
            logger.warning("kvtier: %d storage calls still running after %.1fs; closing under "
                           "them", running, timeout)
        self._loads.close(timeout)
        self.policy.on_close(self.hot, self.allocator.size, self._writers)  # writers still open
        tiers = self._set.shut(timeout)
        self.sessions.close()
        self.allocator.set_evictor(None)
        for tier in [self.hot, *tiers]:
            tier.close()
        self.allocator.close()  # warns if a reader still holds an object (a leak)
        logger.info("kvtier storage closed: %s", self.counters.snapshot())

    # -- internals ---------------------------------------------------------------------------

    def _evict(self, nbytes: int) -> int:
        """Arena callback: free at least `nbytes` by evicting from the hot tier if possible."""
        self.sessions.expire()  # idle sessions' chunks become evictable first
        popped = self.hot.pop_lru(nbytes)
        freed = 0
        # Leaves come first; hand parents down first so no child is an orphan.
        for key, obj in reversed(popped):
            freed += obj.nbytes
            self.policy.on_evict(key, obj, self._writers)
            obj.release()
        if evicted := [key for key, _ in popped]:
            self.admission.evicted(evicted)
            self.watch.removed(self.hot.name, [key.key for key in evicted])
            self.counters.inc("cpu_evictions", len(popped))
        return freed
