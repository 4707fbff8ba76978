"""The storage manager: an ordered list of tiers behind one batched, prefix-aware interface.

Puts land in the CPU tier at once and reach the lower tiers in the background per the write
policy; gets walk the tiers in order and promote lower-tier hits into the CPU tier. Every tier
failure is turned into a miss here, counted and logged at a limited rate.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager

from kvtier.backends import BackendContext, StorageBackend, create_backend
from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.writer import TierWriter

__all__ = ["StorageManager"]

logger = logging.getLogger(__name__)


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
        self.allocator = allocator or MemoryAllocator(int(config.max_local_cpu_size * 1e9))
        self.counters = Counters()
        self._warn = RateLimitedLog(logger)
        self._hits: dict[str, int] = {}  # per-chunk hit counts for write_through_selective
        self._lock = threading.Lock()
        ctx = BackendContext(config=config, layout=layout, allocator=self.allocator)
        self.tiers: list[StorageBackend] = []
        try:
            for name in config.tiers:
                self.tiers.append(create_backend(name, ctx))
        except BaseException:
            for tier in self.tiers:
                tier.close()
            raise
        self.cpu = next((t for t in self.tiers if isinstance(t, CPUBackend)), None)
        self._writers = [
            TierWriter(t, config.write_queue_chunks, self.counters, self._warn,
                       reachable=self._in_cpu if config.write_policy == "write_back" else
                       _never)
            for t in self.tiers if t is not self.cpu
        ]
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-prefetch")
        self._closed = False
        self.allocator.set_evictor(self._evict)
        logger.info("kvtier storage: tiers %s, write policy %s", [t.name for t in self.tiers],
                    config.write_policy)

    # -- the serving path ------------------------------------------------------------------

    def put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> None:
        """Store `objs` under `keys` (contiguous chunks, in order). Never blocks on a lower
        tier and never takes over the caller's references."""
        if len(keys) != len(objs):
            raise ValueError(f"keys and objs differ in length: {len(keys)} != {len(objs)}")
        if self._closed or not keys:
            return
        if self.cpu is not None:
            self._call(self.cpu, "batch_put", keys, objs)
        if self.cpu is None or self.config.write_policy == "write_through":
            for writer in self._writers:
                writer.submit(keys, objs)
        self.counters.inc("chunks_put", len(keys))

    @contextmanager
    def get(self, keys: Sequence[ChunkKey]) -> Iterator[list[MemoryObj]]:
        """Lease the objects of the leading hits of `keys` for the duration of the block.

        Walks the tiers in order, promotes lower-tier hits into the CPU tier, and stops at the
        first chunk no tier has.
        """
        objs = self._fetch(keys)
        try:
            yield objs
        finally:
            for obj in objs:
                obj.release()

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading `keys` some tier holds (no data moves)."""
        n = 0
        while n < len(keys) and not self._closed:
            for tier in self.tiers:
                got = self._call(tier, "batch_contains", keys[n:]) or 0
                if got:
                    n += got
                    break
            else:
                break
        return n

    def prefetch(self, keys: Sequence[ChunkKey]) -> Future[int]:
        """Start loading lower-tier chunks of `keys` into the CPU tier; waits per
        `prefetch_policy` (`best_effort`: no wait, `wait_complete`: until loaded, `timeout`:
        at most base + per-token budget). The future's result is the number of leading chunks
        available."""
        future = self._prefetcher.submit(self._prefetch_now, list(keys))
        policy = self.config.prefetch_policy
        if policy == "wait_complete":
            future.result()
        elif policy == "timeout":
            tokens = sum(k.num_tokens for k in keys)
            budget = (self.config.prefetch_timeout_base_ms
                      + self.config.prefetch_timeout_per_token_ms * tokens) / 1000
            try:
                future.result(timeout=budget)
            except FutureTimeout:
                self.counters.inc("prefetch_timeouts")
        return future

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Delete `keys` from every tier; returns the most any one tier deleted."""
        return max((self._call(t, "remove", keys) or 0 for t in self.tiers), default=0)

    def stats(self) -> dict[str, float]:
        """Manager counters plus every tier's stats as `tier.name` entries."""
        out: dict[str, float] = dict(self.counters.snapshot())
        for tier in self.tiers:
            for name, value in (self._call(tier, "stats") or {}).items():
                out[f"{tier.name}.{name}"] = value
        for writer in self._writers:
            out[f"{writer.backend.name}.write_queue"] = writer.pending()
        out["arena_used_bytes"] = self.allocator.used_bytes
        out["arena_bytes"] = self.allocator.size
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every lower-tier write queued so far is done; False on timeout."""
        timeout = self.config.blocking_timeout_secs if timeout is None else timeout
        drained = [w.drain(timeout) for w in self._writers]  # wait for every writer
        return all(drained)

    def close(self) -> None:
        """Drain background writes (bounded by `blocking_timeout_secs`), then close tiers."""
        if self._closed:
            return
        self._prefetcher.shutdown(wait=True)
        if self.config.write_policy == "write_back" and self.cpu is not None:
            # Write-back keeps the only copy in memory: hand it down, parents first.
            for key, obj in reversed(self.cpu.pop_lru(self.allocator.size)):
                for writer in self._writers:
                    writer.submit([key], [obj])
                obj.release()
        self._closed = True
        for writer in self._writers:
            writer.close(self.config.blocking_timeout_secs)
        self._writers = []
        self.allocator.set_evictor(None)
        for tier in self.tiers:
            self._call(tier, "close")
        logger.info("kvtier storage closed: %s", self.counters.snapshot())

    # -- internals ---------------------------------------------------------------------------

    def _fetch(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        objs: list[MemoryObj] = []
        while len(objs) < len(keys) and not self._closed:
            for tier in self.tiers:
                got: list[MemoryObj] = self._call(tier, "batch_get", keys[len(objs):]) or []
                if not got:
                    continue
                hit_keys = keys[len(objs):len(objs) + len(got)]
                self.counters.inc(f"{tier.name}.hit_chunks", len(got))
                if tier is not self.cpu and self.cpu is not None:
                    self._call(self.cpu, "batch_put", hit_keys, got)  # promote
                objs.extend(got)
                break
            else:
                break
        if self.config.write_policy == "write_through_selective" and objs:
            self._count_hits(keys[: len(objs)], objs)
        return objs

    def _count_hits(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> None:
        threshold = self.config.selective_write_threshold
        due: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                count = self._hits.get(key.key, 0) + 1
                self._hits[key.key] = count
                if count == threshold:
                    due.append(i)
            if len(self._hits) > 1_000_000:  # bounded: forget the oldest half
                for name in list(self._hits)[: len(self._hits) // 2]:
                    del self._hits[name]
        if due:
            for writer in self._writers:
                writer.submit([keys[i] for i in due], [objs[i] for i in due])

    def _prefetch_now(self, keys: list[ChunkKey]) -> int:
        with self.get(keys) as objs:
            return len(objs)

    def _evict(self, nbytes: int) -> int:
        """Arena callback: free at least `nbytes` by evicting from the CPU tier if possible."""
        if self.cpu is None:
            return 0
        popped = self.cpu.pop_lru(nbytes)
        freed = 0
        # Leaves come first; write-back hands parents down first so no child is an orphan.
        for key, obj in reversed(popped):
            freed += obj.nbytes
            if self.config.write_policy == "write_back":
                for writer in self._writers:
                    writer.submit([key], [obj])
            obj.release()
        if popped:
            self.counters.inc("cpu_evictions", len(popped))
        return freed

    def _in_cpu(self, key: str) -> bool:
        stub = ChunkKey(key, 0, 0, b"", None)
        return self.cpu is not None and self.cpu.batch_contains([stub]) == 1

    def _call(self, tier: StorageBackend, method: str, *args: object):  # noqa: ANN202
        """Call a tier; any failure is a counted, rate-limited miss."""
        try:
            return getattr(tier, method)(*args)
        except Exception as exc:  # a tier must never take serving down
            self.counters.inc(f"{tier.name}.errors")
            self._warn.warning(f"{tier.name}-{method}", "kvtier: tier %s %s failed: %r",
                               tier.name, method, exc)
            return None


def _never(key: str) -> bool:
    return False
