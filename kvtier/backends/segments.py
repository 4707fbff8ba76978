"""The `arc` eviction policy's bookkeeping for the CPU tier (`kvtier.backends.cpu`): which
segment a stored prefix joins, and which segment gives up the next leaf.

Chunks of a prefix stored for the first time join the *window*; chunks of a prefix this tier
has seen lately (its first new chunk was stored, or evicted, not long ago: lists of key
strings, no data) join the *main* segment. Eviction takes the
least recently used leaf of the window while the window holds more than its target, else of
the main segment. The target adapts as in ARC (Megiddo and Modha, FAST'03): a store whose
first chunk was evicted from the window lately grows it, one evicted from the main segment
shrinks it. So a burst of one-off prompts cycles through the window and leaves the prefixes
that come back alone, and when first-seen prompts are the ones that return (a conversation's
second turn) the window grows until it holds them. Leaf-first eviction is the tier's: a
segment gives up leaves only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.keys import ChunkKey

__all__ = ["Segments", "GHOST_PER_CHUNK", "MAX_GHOST", "WINDOW_START"]

GHOST_PER_CHUNK = 2  # keys remembered per chunk the tier holds, in each list
MAX_GHOST = 1 << 18  # at most this many keys per list (about 30 MB of strings and links)
WINDOW_START = 0.1  # the window's first target, as a share of the tier


class Segments:
    """Not thread-safe: the tier's lock serializes every call.

    Args:
        capacity: chunks the tier holds when full (its arena over one chunk's bytes).
    """

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.target = WINDOW_START * self.capacity  # chunks the window may hold
        self._ghost_cap = min(MAX_GHOST, GHOST_PER_CHUNK * self.capacity)
        self._seen: OrderedDict[str, None] = OrderedDict()  # keys offered lately
        self._gone_window: OrderedDict[str, None] = OrderedDict()  # evicted from the window
        self._gone_main: OrderedDict[str, None] = OrderedDict()

    def joins_main(self, keys: Sequence[ChunkKey]) -> bool:
        """Whether the chunks of a put (a prefix's next chunks, in order) join the main
        segment: its first chunk was offered or evicted lately. Adapts the window's target
        to where that chunk was evicted from."""
        first = keys[0].key
        window, main = self._gone_window, self._gone_main
        known = first in self._seen
        if window.pop(first, 0) is None:
            grow = len(keys) * max(1, len(main) / max(1, len(window)))
            self.target = min(self.capacity, self.target + grow)
            known = True
        elif main.pop(first, 0) is None:
            shrink = len(keys) * max(1, len(window) / max(1, len(main)))
            self.target = max(0.0, self.target - shrink)
            known = True
        seen = self._seen
        for k in keys:  # held now: out of the ghost lists, into what was seen (the newest)
            name = k.key
            seen[name] = None
            seen.move_to_end(name)
            window.pop(name, None)
            main.pop(name, None)
        while len(seen) > self._ghost_cap:
            seen.popitem(last=False)
        return known

    def evicted(self, name: str, main: bool) -> None:
        _remember(self._gone_main if main else self._gone_window, name, self._ghost_cap)

    def window_first(self, window_chunks: int) -> bool:
        """Whether the next victim comes from the window (it holds more than its target)."""
        return window_chunks > self.target

    def stats(self) -> dict[str, float]:
        return {"window_target_chunks": round(self.target, 1)}


def _remember(ghost: OrderedDict[str, None], name: str, cap: int) -> None:
    ghost[name] = None
    ghost.move_to_end(name)
    if len(ghost) > cap:
        ghost.popitem(last=False)
