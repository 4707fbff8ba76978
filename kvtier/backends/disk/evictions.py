"""The key strings of the records this disk tier wrote, for naming the ones it evicts.

The index knows a record by its file name, a one-way hash of its key, and a router watching
the tiers (`StorageBackend.watch_evictions`) needs the key. Only while somebody watches, the
tier notes each record it writes here, so that its own evictions (the cap, a full filesystem)
can be told by key. Bounded: the oldest notes go first, and a record evicted after its note
went is not told (a router then keeps a stale entry, which it ages out as for any server).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvtier.backends.base import EvictionWatch

__all__ = ["EvictionNotes", "MAX_NOTES"]

MAX_NOTES = 1 << 17  # as many chunks as the events' own memory of announced chunks


class EvictionNotes:
    """File name -> key string of recent writes, and the watch told of evictions. Called
    under the disk tier's lock (no locking of its own)."""

    def __init__(self, tier: str, limit: int = MAX_NOTES) -> None:
        self._tier = tier
        self._limit = limit
        self._keys: OrderedDict[str, str] = OrderedDict()
        self.watch: EvictionWatch | None = None

    def wrote(self, name: str, key: str) -> None:
        if self.watch is None or not self.watch.watching:
            return
        self._keys[name] = key
        self._keys.move_to_end(name)
        if len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def forget(self, names: Iterable[str]) -> list[str]:
        """Drop the notes of `names`; their key strings, of those noted."""
        return [key for name in names if (key := self._keys.pop(name, None)) is not None]

    def evicted(self, names: Iterable[str]) -> None:
        """The tier evicted `names`: tell the watch those it has notes of."""
        keys = self.forget(names)
        if keys and self.watch is not None:
            self.watch.removed(self._tier, keys)
