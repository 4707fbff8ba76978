"""The disk tier's eviction order under `eviction_policy: lfuda`: LFU with dynamic aging over its
records, the CPU tier's policy (`kvtier.backends.cpu_lfuda`) on the disk index's record names.

Each record counts its uses: its store, each read that serves it and each hit of its chunk in
the CPU tier (`StorageBackend.touch`). Its priority is the tier's age plus its count at its last
use; the evictable leaf of least priority goes first (ties: the one queued first), and the age
rises to the priority of what is evicted, so a count earned long ago fades. Evicted records'
counts wait in a bounded ghost list, so a prefix written again resumes its count.

Chains: a record's parent (its key's `prev`) is known when this process wrote it. A record with
an indexed child is not a leaf and is never picked before that child, so a prefix is taken from
its end, never holed. Records indexed from the directory at start-up, or adopted from another
process, carry no parent (a file name is a one-way hash and a header does not name its prefix):
they are queued oldest mtime first, all with one use, which is LRU's order (a batch's first
chunk is stamped newest), so among them lfuda risks exactly what `lru` risks, a hole where a
prefix's middle is older than its end. That is safe: a read stops at the first miss, so a hole
shortens a hit and never serves a wrong chunk; and a chunk written under such a parent links
to it, so the parent is protected from then on.

Counts do not survive a restart: keeping them would cost a write per use (a header rewrite or an
mtime code) or a side file that a killed process leaves stale. After a restart lfuda starts from
LRU's order (above) and counts again.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence

__all__ = ["DiskFrequency", "GHOST_PER_RECORD", "MAX_GHOST"]

GHOST_PER_RECORD = 8  # evicted records' counts remembered per record held (the CPU tier's 8)
MAX_GHOST = 1 << 18  # at most this many (about 30 MB of names and ints)
_MIN_GHOST = 1024  # a small tier still remembers a few prefixes


class DiskFrequency:
    """Counts, priorities and the leaves' heap of the disk index's records. Not thread-safe: the
    index's caller serializes every call."""

    def __init__(self) -> None:
        self.age = 0.0
        self._counts: dict[str, int] = {}  # indexed record -> uses
        self._prio: dict[str, float] = {}  # indexed record -> age + uses at its last use
        self._parent: dict[str, str] = {}  # indexed record -> its parent's name, where known
        self._kids: dict[str, int] = {}  # name -> indexed records whose parent it is
        self._ghost: OrderedDict[str, int] = OrderedDict()  # evicted record -> uses
        self._heap: list[tuple[float, int, str]] = []  # stale entries skipped, compacted
        self._live: dict[str, tuple[float, int, str]] = {}  # leaf -> its heap entry (`is`)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, name: str, parent: str | None = None) -> None:
        """Record `name` (not indexed) was stored, one use (its ghost's count resumes), under
        `parent` when known: the parent stops being a leaf while `name` is indexed."""
        count = self._ghost.pop(name, 0) + 1
        self._counts[name] = count
        prio = self._prio[name] = self.age + count
        if parent is not None and parent != name:
            self._parent[name] = parent
            self._kids[parent] = self._kids.get(parent, 0) + 1
            self._live.pop(parent, None)  # its heap entry is stale from now on
        if not self._kids.get(name):
            self._push(name, prio)

    def use(self, names: Sequence[str]) -> None:
        """A prefix (`names`, first chunk first) was used: one use each, of those indexed;
        leaves are requeued deepest first, so among equals a prefix goes from its end."""
        counts, prio, live, age = self._counts, self._prio, self._live, self.age
        for name in reversed(names):
            count = counts.get(name)
            if count is None:
                continue
            count = counts[name] = count + 1
            prio[name] = age + count
            if name in live:
                self._push(name, age + count)

    def drop(self, name: str, evicted: bool) -> None:
        """`name` left the index; an evicted one ages the tier to its priority and leaves its
        count in the ghost list (a removed one is forgotten). A parent left childless becomes a
        leaf with the priority of its last use."""
        count = self._counts.pop(name, None)
        if count is None:
            return
        prio = self._prio.pop(name)
        self._live.pop(name, None)
        parent = self._parent.pop(name, None)
        if parent is not None:
            left = self._kids[parent] - 1
            if left:
                self._kids[parent] = left
            else:
                del self._kids[parent]
                if parent in self._counts:
                    self._push(parent, self._prio[parent])
        if evicted:
            self.age = max(self.age, prio)
            ghost = self._ghost
            ghost[name] = count
            ghost.move_to_end(name)
            cap = min(MAX_GHOST, GHOST_PER_RECORD * max(_MIN_GHOST, len(self._counts)))
            while len(ghost) > cap:
                ghost.popitem(last=False)

    def walk(self, taken: set[str]) -> Iterator[str]:
        """The leaves in eviction order, without changing anything. After the caller resumes
        it, a yielded name found in `taken` (the caller will evict it) counts as gone: a parent
        it leaves childless is yielded in its turn, so one pick may take a prefix's end and
        then the chunk before it. Nothing may change the heap while a walk is in progress."""
        heap, live, prio = self._heap, self._live, self._prio
        # The heap read in order without popping it: a second heap of the first unread entries.
        frontier: list[tuple[tuple[float, int, str], int]] = [(heap[0], 0)] if heap else []
        freed: dict[str, int] = {}  # parent -> its children not taken yet
        seq = self._seq
        while frontier:
            entry, i = heapq.heappop(frontier)
            if i >= 0:
                for j in (2 * i + 1, 2 * i + 2):
                    if j < len(heap):
                        heapq.heappush(frontier, (heap[j], j))
                if live.get(entry[2]) is not entry:
                    continue
            name = entry[2]
            yield name
            parent = self._parent.get(name)
            if name in taken and parent is not None and parent in prio:
                left = freed.get(parent, self._kids[parent]) - 1
                freed[parent] = left
                if not left:  # a leaf now, queued after everything queued before
                    seq += 1
                    heapq.heappush(frontier, ((prio[parent], seq, parent), -1))

    def ghost_names(self) -> int:
        return len(self._ghost)

    def check(self, names: set[str]) -> None:
        """Raise `AssertionError` unless the books match the index's `names` (for tests)."""
        assert set(self._counts) == names, "counted records differ from the index"
        leaves = {n for n in names if not self._kids.get(n)}
        assert set(self._live) == leaves, "queued leaves differ from the childless records"
        assert set(self._parent) <= names, "a parent link outlived its record"

    def _push(self, name: str, prio: float) -> None:
        self._seq += 1
        entry = (prio, self._seq, name)
        self._live[name] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 1024:  # stale entries: drop them now and then
            live = self._live
            self._heap = [e for e in self._heap if live.get(e[2]) is e]
            heapq.heapify(self._heap)
