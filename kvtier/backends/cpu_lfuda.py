"""The CPU tier under `eviction_policy: lfuda`: the LRU tier (`kvtier.backends.cpu`) with its
leaves ordered by frequency with dynamic aging (LFU-DA, Arlitt et al., 2000).

Each chunk counts its uses: one when it is stored, one per request it serves. Its priority is
the tier's *age* plus its count, fixed when it is stored or served; the leaf of least priority
goes first (ties: the one queued first, so a prefix stored or served together is taken from
its end; a parent left a leaf by its child's eviction queues anew with its own priority), and
the age becomes that leaf's priority. A chunk stored now starts one above the age, so a chunk
used often long ago keeps its place only until the age has caught up with its count:
frequency, weighed against recency. A chunk's place in its chain
counts through the tier's rule (leaves only) and through the counts themselves: a request
that uses a chunk uses its whole prefix, so a parent's count is never below its child's.

Counts outlive their chunk for a while: an evicted chunk's count waits in a bounded ghost list
(key strings and ints, no data), so a prefix that comes back after its eviction resumes its
count instead of starting over. Mooncake's traces (docs/policies.md, in a model of the tier):
a ghost of 8 keys per chunk the tier holds came within 0.02x of LRU's hit rate of an unbounded
memory at 1M-10M tokens (0.11x below it at synthetic 0.1M); 1 or 0 keys per chunk lost most of
the gain (conversation 1M: 1.13x and 1.04x LRU, against 1.42x with 8).

Leaf-first eviction, pins, references and the tenant share are the LRU tier's, unchanged.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.keys import ChunkKey
from kvtier.memory import ALIGN

__all__ = ["FrequencyLeaves", "LFUDABackend", "GHOST_PER_CHUNK", "MAX_GHOST"]

GHOST_PER_CHUNK = 8  # evicted chunks' counts remembered per chunk the tier holds
MAX_GHOST = 1 << 18  # at most this many (about 30 MB of strings, ints and links)


class FrequencyLeaves:
    """The tier's leaves queued by priority (age + count), with the calls the tier makes on its
    queue: `in`, iteration (eviction order), `pop`, `setdefault`, `move_to_end`, `clear`. Also
    holds every held chunk's count (`counted`, `served`, `dropped`).

    The queue is a bucket per priority (an `OrderedDict` of leaves, in the order they were
    queued at it) and a heap of the buckets' priorities: priorities are whole numbers near the
    age, so the heap holds a few numbers where a heap of leaves held every leaf, and taking
    the first leaf costs a dict read instead of a heap pop's dozens of tuple comparisons.
    A leaf popped stays in its bucket, stale (`_live` says where it is queued), until it
    reaches the front or a compaction; queued again at the same priority it moves to the end.

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
        self._buckets: dict[float, OrderedDict[str, None]] = {}  # priority -> leaves queued
        self._order: list[float] = []  # a heap of the buckets' priorities, each once
        self._live: dict[str, float] = {}  # leaf -> the priority it is queued at
        self._queued = 0  # names in the buckets, stale ones included (compacted when many)
        # The tier calls `pop` per chunk stored and evicted: the dict's own method, no Python
        # frame (a leaf out of `_live` is stale in its bucket from then on).
        self.pop = self._live.pop  # type: ignore[method-assign,assignment]

    def __contains__(self, name: object) -> bool:
        return name in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[str]:
        # Eviction order. Rare (the first leaf was in use, or a tenant share walk): the tier
        # reads the first leaf itself (`LFUDABackend._first_leaf`).
        live, buckets = self._live, self._buckets
        for prio in sorted(self._order):
            for name in buckets[prio]:
                if live.get(name) == prio:
                    yield name

    def pop(self, name: str, default: None = None) -> None:  # replaced by `_live.pop`
        self._live.pop(name, None)

    def setdefault(self, name: str, value: None = None) -> None:
        live = self._live
        if name not in live:
            prio = self._prio.get(name)
            if prio is None:
                self.counted(name)
                prio = self._prio[name]
            # `_push`, inlined: once per chunk evicted (its parent becomes a leaf).
            live[name] = prio
            bucket = self._buckets.get(prio)
            if bucket is None:
                bucket = self._buckets[prio] = OrderedDict()
                heapq.heappush(self._order, prio)
            if name in bucket:
                bucket.move_to_end(name)
            else:
                bucket[name] = None
                self._queued += 1
                if self._queued > 2 * len(live) + 1024:
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
        self._buckets.clear()
        self._order.clear()
        self._live.clear()
        self._queued = 0

    def ghost_keys(self) -> int:
        return len(self._ghost)

    def _push(self, name: str, prio: float) -> None:
        """Queue `name` last at `prio` (moved there if a stale entry of it is in that bucket)."""
        self._live[name] = prio  # first: a compaction keeps the live names only
        bucket = self._buckets.get(prio)
        if bucket is None:
            bucket = self._buckets[prio] = OrderedDict()
            heapq.heappush(self._order, prio)
        if name in bucket:
            bucket.move_to_end(name)
        else:
            bucket[name] = None
            self._queued += 1
            if self._queued > 2 * len(self._live) + 1024:
                self._compact()

    def _compact(self) -> None:
        """Drop the buckets' stale names (now and then: they are skipped until then)."""
        live, kept = self._live, {}
        for prio, bucket in self._buckets.items():
            names = [n for n in bucket if live.get(n) == prio]
            if names:
                kept[prio] = OrderedDict.fromkeys(names)
        self._buckets = kept
        self._order = list(kept)
        heapq.heapify(self._order)
        self._queued = sum(map(len, kept.values()))


class LFUDABackend(CPUBackend):
    """`CPUBackend` with `FrequencyLeaves` (see the module docstring)."""

    _parent_next = False  # its priority places it (`FrequencyLeaves.move_to_end`)

    def __init__(self, ctx: BackendContext, *, name: str | None = None):
        super().__init__(ctx, name=name)
        # Insertion order only (no decision reads recency here): a dict's, cheaper to add to
        # and pop from than an `OrderedDict`, once per chunk stored and evicted.
        self._entries = {}  # type: ignore[assignment]
        chunk = -(-ctx.layout.nbytes(ctx.config.chunk_size) // ALIGN) * ALIGN
        chunks = max(1, ctx.allocator.size // chunk)
        self._freq = FrequencyLeaves(min(MAX_GHOST, GHOST_PER_CHUNK * chunks))
        self._leaves = self._freq
        # The hooks are the counts' own methods, one Python frame fewer a call.
        self._on_drop = self._freq.dropped  # type: ignore[method-assign]
        self._on_put = self._freq.stored  # type: ignore[method-assign]
        self._on_hit = self._freq.served  # type: ignore[method-assign]

    def _on_put(self, keys: Sequence[ChunkKey]) -> None:  # replaced by `stored` in __init__
        # Leaves were counted as they were queued; the chunks stored under a child are now.
        self._freq.stored(keys)

    def _on_hit(self, keys: Sequence[ChunkKey]) -> None:  # replaced by `served` in __init__
        # Served chunks are requeued by their counts; the entries' order (LRU's recency) is
        # read by no decision here, so it is not kept.
        self._freq.served(keys)

    def _first_leaf(self) -> str | None:
        # The first live leaf of the lowest priority's bucket, read here: once per chunk
        # evicted, one frame. It leaves its bucket now (`pop_lru` evicts it); stale names met
        # at a bucket's front go too, and empty buckets.
        freq = self._freq
        order, buckets, live = freq._order, freq._buckets, freq._live
        while order:
            prio = order[0]
            bucket = buckets[prio]
            if not bucket:
                heapq.heappop(order)
                del buckets[prio]
                continue
            name = bucket.popitem(last=False)[0]
            if live.get(name) != prio:  # stale
                freq._queued -= 1
                continue
            if self._entries[name][1].refs == 1:
                freq._queued -= 1
                return name
            bucket[name] = None  # in use right now: back to the front, and walk on in order
            bucket.move_to_end(name, last=False)
            return super()._first_leaf()
        return None

    def _on_drop(self, name: str, evicted: bool) -> None:  # replaced by `dropped` in __init__
        self._freq.dropped(name, evicted)

