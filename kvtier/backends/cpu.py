"""The hot tier: memory objects resident in the arena, LRU by chunk (`eviction_policy: lru`), or
in two LRU segments (`arc`: first-seen prefixes in a window, prefixes seen before in the main
segment, the split adapted to which comes back: `kvtier.backends.segments`).

Eviction takes suffixes first, so a lookup after memory pressure still finds a usable prefix
rather than holes: a batch is touched from its last chunk to its first (within a prefix the
deeper chunks are older), and only leaves are evicted: a chunk whose child is cached stays until
the child is gone, however the chunks were put (one call or many).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from itertools import chain

from kvtier.backends.base import BackendContext, HotTier
from kvtier.backends.segments import Segments
from kvtier.config.names import ARC, CPU
from kvtier.keys import ChunkKey
from kvtier.memory import ALIGN, MemoryObj

__all__ = ["CPUBackend"]


class CPUBackend(HotTier):
    """Holds one reference to every stored object; `pop_lru` hands references back."""

    name = CPU

    def __init__(self, ctx: BackendContext, *, name: str | None = None):
        if name is not None:  # another role (`staging`): its counters' prefix too
            self.name = name
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[ChunkKey, MemoryObj]] = OrderedDict()  # LRU first
        self._children: dict[str, int] = {}  # key -> number of cached chunks whose prev it is
        # The entries eviction may take (no cached child, not pinned), in LRU order: an
        # eviction never walks past pinned chunks or parents (thousands of sessions' pins made
        # every store walk them all).
        self._leaves: OrderedDict[str, None] = OrderedDict()
        # arc: the main segment's chunks (`_main`; empty under lru) and its leaves (`_leaves`
        # then holds the window's).
        self._main_leaves: OrderedDict[str, None] = OrderedDict()
        self._main: set[str] = set()
        self._segments: Segments | None = None
        if ctx.config.eviction_policy == ARC:
            chunk = -(-ctx.layout.nbytes(ctx.config.chunk_size) // ALIGN) * ALIGN
            self._segments = Segments(ctx.allocator.size // chunk)
        self._pins: Counter[str] = Counter()  # key -> number of holders pinning it
        self._pinned_bytes = 0
        self._bytes = 0
        self._counts = ctx.counters.scope(self.name, "hits", "misses", "puts", "evictions")
        self._closed = False

    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                if k.key not in self._entries:
                    break
                n += 1
            return n

    def first_held(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            return next((i for i, k in enumerate(keys) if k.key in self._entries), -1)

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        with self._lock:
            out: list[MemoryObj] = []
            for k in keys:
                entry = self._entries.get(k.key)
                # Same key string but other tokens can only be a digest collision: a miss.
                if entry is None or entry[0].tokens != k.tokens:
                    self._counts.inc("misses")
                    break
                out.append(entry[1].retain())
            self._counts.inc("hits", len(out))
            for k in reversed(keys[: len(out)]):
                self._entries.move_to_end(k.key)
                if k.key in self._leaves:
                    self._leaves.move_to_end(k.key)
                elif k.key in self._main_leaves:
                    self._main_leaves.move_to_end(k.key)
            return out

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        if len(keys) != len(objs):
            raise ValueError(f"keys and objs differ in length: {len(keys)} != {len(objs)}")
        with self._lock:
            if self._closed:
                return 0
            main = bool(keys) and self._segments is not None and self._segments.joins_main(keys)
            for k, obj in zip(reversed(keys), reversed(objs)):
                old = self._drop_locked(k.key)
                if old is not None:
                    old[1].release()
                if main:
                    self._main.add(k.key)
                self._entries[k.key] = (k, obj.retain())
                self._bytes += obj.nbytes
                if k.key in self._pins:
                    self._pinned_bytes += obj.nbytes
                self._sync_leaf(k.key)
                if k.prev is not None:
                    self._children[k.prev] = self._children.get(k.prev, 0) + 1
                    self._leaves.pop(k.prev, None)
                    self._main_leaves.pop(k.prev, None)
            self._counts.inc("puts", len(keys))
            return len(keys)

    def pin(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                entry = self._entries.get(k.key)
                if entry is None:
                    break
                if not self._pins[k.key]:
                    self._pinned_bytes += entry[1].nbytes
                    self._leaves.pop(k.key, None)
                    self._main_leaves.pop(k.key, None)
                self._pins[k.key] += 1
                n += 1
            return n

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for k in keys:
                left = self._pins[k.key] - 1
                if left > 0:
                    self._pins[k.key] = left
                    continue
                del self._pins[k.key]
                entry = self._entries.get(k.key)
                if entry is not None:
                    self._pinned_bytes -= entry[1].nbytes
                    self._sync_leaf(k.key)

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_bytes

    def pop_lru(self, nbytes: int) -> list[tuple[ChunkKey, MemoryObj]]:
        out: list[tuple[ChunkKey, MemoryObj]] = []
        freed = 0
        with self._lock:
            while freed < nbytes:
                # Leaves only (no holes, nothing pinned), least recent first, skipping chunks
                # in use right now; evicting a leaf makes its parent the next one.
                victim = next((n for n in chain(*self._victim_order())
                               if self._entries[n][1].refs == 1), None)
                if victim is None:
                    break
                if self._segments is not None:
                    self._segments.evicted(victim, victim in self._main)
                entry = self._drop_locked(victim)
                assert entry is not None
                freed += entry[1].nbytes
                out.append(entry)
            self._counts.inc("evictions", len(out))
        return out

    def _victim_order(self) -> tuple[OrderedDict[str, None], OrderedDict[str, None]]:
        """The leaf queues eviction walks, in order: the window's first while it is over its
        target (`arc`); under lru the main queue is empty."""
        seg = self._segments
        if seg is None or seg.window_first(len(self._entries) - len(self._main)):
            return self._leaves, self._main_leaves
        return self._main_leaves, self._leaves

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                entry = self._drop_locked(k.key)
                if entry is not None:
                    entry[1].release()
                    n += 1
            return n

    def _drop_locked(self, name: str) -> tuple[ChunkKey, MemoryObj] | None:
        """Unlink an entry; the caller gets the tier's reference."""
        entry = self._entries.pop(name, None)
        if entry is not None:
            self._leaves.pop(name, None)
            self._main_leaves.pop(name, None)
            self._main.discard(name)
            self._bytes -= entry[1].nbytes
            if name in self._pins:  # removed while pinned: its pins now hold nothing
                self._pinned_bytes -= entry[1].nbytes
            prev = entry[0].prev
            if prev is not None:
                left = self._children[prev] - 1
                if left:
                    self._children[prev] = left
                else:
                    del self._children[prev]
                    if self._sync_leaf(prev):  # a prefix's next chunk to go: evicted next
                        self._queue(prev).move_to_end(prev, last=False)
        return entry

    def _queue(self, name: str) -> OrderedDict[str, None]:
        return self._main_leaves if name in self._main else self._leaves

    def _sync_leaf(self, name: str) -> bool:
        """Keep `name` among the leaves iff it is cached, childless and unpinned; whether it is."""
        if name in self._entries and not self._children.get(name) and name not in self._pins:
            self._queue(name).setdefault(name, None)
            return True
        self._leaves.pop(name, None)
        self._main_leaves.pop(name, None)
        return False

    def stats(self) -> dict[str, float]:
        with self._lock:
            gauges = {"entries": len(self._entries), "bytes": self._bytes,
                      "pinned_bytes": self._pinned_bytes,
                      **(self._segments.stats() if self._segments is not None else {})}
        return {**self._counts.snapshot(declared=True), **gauges}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries, self._entries = self._entries, OrderedDict()
            self._children.clear()
            self._leaves.clear()
            self._main_leaves.clear()
            self._main.clear()
            self._bytes = 0
        for _, obj in entries.values():
            obj.release()
