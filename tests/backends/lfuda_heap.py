"""The CPU tier's lfuda queue as it was before its buckets (kvtier at 15da8f7): one heap of
leaves. The reference `tests/backends/test_cpu_lfuda_buckets.py` compares the buckets against:
the same decisions on the same operations."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.backends.cpu_lfuda import GHOST_PER_CHUNK, MAX_GHOST, LFUDABackend
from kvtier.keys import ChunkKey
from kvtier.memory import ALIGN

__all__ = ["HeapLFUDA", "HeapLeaves"]


class HeapLeaves:
    """`FrequencyLeaves` before 2026-12-07: the leaves in one heap of (priority, sequence, name)
    entries, stale entries skipped by identity.

    Not thread-safe: the tier's lock serializes every call.

    Args:
        ghost_cap: evicted chunks whose counts are remembered, at most (oldest forgotten).
    """

    def __init__(self, ghost_cap: int):
        self.age = 0.0
        self._counts: dict[str, int] = {}  # held chunk -> uses
        self._prio: dict[str, float] = {}  # held chunk -> age + uses at its last store or hit
        self._ghost: OrderedDict[str, int] = OrderedDict()  # evicted chunk -> uses
        self._ghost_cap = max(0, ghost_cap)
        self._heap: list[tuple[float, int, str]] = []  # stale entries skipped, compacted
        # Leaf -> its live heap entry, the same object: an entry is live iff `is` it (a cheaper
        # test than comparing tuples, on every eviction).
        self._live: dict[str, tuple[float, int, str]] = {}
        self._seq = 0
        # The tier calls `pop` per chunk stored and evicted: the dict's own method, no Python
        # frame (a leaf's heap entry is stale once it is out of `_live`).
        self.pop = self._live.pop  # type: ignore[method-assign,assignment]

    def __contains__(self, name: object) -> bool:
        return name in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[str]:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)
        if not heap:
            return
        yield heap[0][2]
        # The caller went on (the first leaf was in use, or a tenant share walk): the rest in
        # order, sorted once; rare, so the heap's top stays the common path's only cost.
        rest = sorted(e for e in heap if live.get(e[2]) is e)
        for entry in rest[1:]:
            yield entry[2]

    def pop(self, name: str, default: None = None) -> None:  # replaced by `_live.pop`
        self._live.pop(name, None)  # its heap entry is stale from now on

    def setdefault(self, name: str, value: None = None) -> None:
        if name not in self._live:
            prio = self._prio.get(name)
            if prio is None:
                self.counted(name)
                prio = self._prio[name]
            # `_push`, inlined: once per chunk evicted (its parent becomes a leaf).
            self._seq += 1
            entry = self._live[name] = (prio, self._seq, name)
            heapq.heappush(self._heap, entry)
            if len(self._heap) > 2 * len(self._live) + 1024:
                self._compact()

    def move_to_end(self, name: str, last: bool = True) -> None:
        """Recency is the age's business: a served leaf is requeued by `served`, and a parent
        whose last child went keeps the priority of its last store or hit (measured on the
        traces: requeued first among equals it hit less)."""

    def counted(self, name: str) -> int:
        """`name`'s uses, a store counted as one (its ghost's count resumes if remembered);
        a chunk counted for the first time gets its priority, the age plus that count."""
        count = self._counts.get(name)
        if count is None:
            count = self._ghost.pop(name, 0) + 1
            self._counts[name] = count
            self._prio[name] = self.age + count
        return count

    def stored(self, keys: Sequence[ChunkKey]) -> None:
        """`keys` were stored: each counted (`counted`), in one call."""
        counts, prio, ghost, age = self._counts, self._prio, self._ghost, self.age
        for k in keys:
            name = k.key
            if name not in counts:
                count = counts[name] = ghost.pop(name, 0) + 1 if ghost else 1
                prio[name] = age + count

    def served(self, keys: Sequence[ChunkKey]) -> None:
        """A request was served `keys` (held): one use each, leaves requeued deepest first."""
        counts, prio, live, age = self._counts, self._prio, self._live, self.age
        for k in reversed(keys):
            name = k.key
            count = counts[name] = counts.get(name, 0) + 1
            prio[name] = age + count
            if name in live:
                self._push(name, age + count)

    def dropped(self, name: str, evicted: bool) -> None:
        """`name` left the tier; an evicted one ages the tier to its priority and leaves its
        count in the ghost list (a removed one is forgotten)."""
        count = self._counts.pop(name, 0)
        prio = self._prio.pop(name, 0.0)
        if not evicted:
            return
        if prio > self.age:
            self.age = prio
        if self._ghost_cap:
            ghost = self._ghost
            # Never there: a held chunk's ghost entry went when it was counted. So the
            # assignment appends it, as the newest, without a move.
            ghost[name] = count
            if len(ghost) > self._ghost_cap:
                ghost.popitem(last=False)

    def clear(self) -> None:
        self._counts.clear()
        self._prio.clear()
        self._ghost.clear()
        self._heap.clear()
        self._live.clear()

    def ghost_keys(self) -> int:
        return len(self._ghost)

    def _push(self, name: str, prio: float) -> None:
        self._seq += 1
        entry = (prio, self._seq, name)
        self._live[name] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 1024:
            self._compact()

    def _compact(self) -> None:
        """Drop the heap's stale entries (now and then: they are skipped until then)."""
        live = self._live
        self._heap = [e for e in self._heap if live.get(e[2]) is e]
        heapq.heapify(self._heap)


class HeapLFUDA(LFUDABackend):
    """`LFUDABackend` on `HeapLeaves` (its `_first_leaf` of then); entries in an `OrderedDict`."""

    def __init__(self, ctx: BackendContext, *, name: str | None = None):
        super().__init__(ctx, name=name)
        self._entries = OrderedDict()
        chunk = -(-ctx.layout.nbytes(ctx.config.chunk_size) // ALIGN) * ALIGN
        chunks = max(1, ctx.allocator.size // chunk)
        self._freq = HeapLeaves(min(MAX_GHOST, GHOST_PER_CHUNK * chunks))  # type: ignore[assignment]
        self._leaves = self._freq
        self._on_drop = self._freq.dropped  # type: ignore[method-assign]
        self._on_put = self._freq.stored  # type: ignore[method-assign]
        self._on_hit = self._freq.served  # type: ignore[method-assign]

    def _first_leaf(self) -> str | None:
        # The heap's first live leaf, read here: once per chunk evicted, one frame.
        heap, live = self._freq._heap, self._freq._live
        while heap:
            entry = heap[0]
            if live.get(entry[2]) is entry:
                if self._entries[entry[2]][1].refs == 1:
                    return entry[2]
                break
            heapq.heappop(heap)
        return CPUBackend._first_leaf(self)  # the first leaf is in use: walk on, in order

