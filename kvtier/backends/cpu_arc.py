"""The CPU tier under `eviction_policy: arc`: the LRU tier (`kvtier.backends.cpu`) with its
leaves in two segments, as `kvtier.backends.segments` decides: prefixes stored for the first
time wait in a window, prefixes that come back live in the main segment, and eviction takes
the window's least recently used leaf while the window is over its adaptive target, else the
main segment's. Leaf-first eviction, pins and references are the LRU tier's, unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence, Sized
from itertools import chain

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.backends.segments import Segments
from kvtier.keys import ChunkKey
from kvtier.memory import ALIGN

__all__ = ["ARCBackend", "SegmentedLeaves"]


class SegmentedLeaves:
    """The tier's leaves as two LRU queues (window, main), with the calls the tier makes on
    one queue: `in`, iteration (eviction order), `pop`, `setdefault`, `move_to_end`, `clear`.
    A leaf's queue is its chunk's segment (`main` holds the main segment's chunks, leaves or
    not)."""

    def __init__(self, segments: Segments, entries: Sized):
        self.window: OrderedDict[str, None] = OrderedDict()
        self.main_leaves: OrderedDict[str, None] = OrderedDict()
        self.main: set[str] = set()
        self._segments = segments
        self._entries = entries  # the tier's: the window's size is theirs less the main's

    def __contains__(self, name: object) -> bool:
        return name in self.window or name in self.main_leaves

    def __iter__(self) -> Iterator[str]:
        if self._segments.window_first(len(self._entries) - len(self.main)):
            return chain(self.window, self.main_leaves)
        return chain(self.main_leaves, self.window)

    def __len__(self) -> int:
        return len(self.window) + len(self.main_leaves)

    def pop(self, name: str, default: None = None) -> None:
        if self.window.pop(name, 0) is not None:
            self.main_leaves.pop(name, None)

    def setdefault(self, name: str, value: None = None) -> None:
        (self.main_leaves if name in self.main else self.window).setdefault(name, value)

    def move_to_end(self, name: str, last: bool = True) -> None:
        (self.main_leaves if name in self.main else self.window).move_to_end(name, last)

    def clear(self) -> None:
        self.window.clear()
        self.main_leaves.clear()
        self.main.clear()


class ARCBackend(CPUBackend):
    """`CPUBackend` with `SegmentedLeaves` (see the module docstring)."""

    def __init__(self, ctx: BackendContext, *, name: str | None = None):
        super().__init__(ctx, name=name)
        chunk = -(-ctx.layout.nbytes(ctx.config.chunk_size) // ALIGN) * ALIGN
        self._segments = Segments(ctx.allocator.size // chunk)
        self._leaves = SegmentedLeaves(self._segments, self._entries)

    def _on_put(self, keys: Sequence[ChunkKey]) -> None:
        # Stored as window chunks (a re-stored key's drop left the main segment); a prefix
        # that came back moves over, its leaves to the main queue's recent end.
        if not keys or not self._segments.joins_main(keys):
            return
        leaves: SegmentedLeaves = self._leaves
        for k in reversed(keys):
            leaves.main.add(k.key)
            if leaves.window.pop(k.key, 0) is None:
                leaves.main_leaves[k.key] = None

    def _on_drop(self, name: str, evicted: bool) -> None:
        main: set[str] = self._leaves.main
        if evicted:
            self._segments.evicted(name, name in main)
        main.discard(name)

    def stats(self) -> dict[str, float]:
        with self._lock:
            segment = {**self._segments.stats(), "main_entries": len(self._leaves.main)}
        return {**super().stats(), **segment}
