"""Each tier's own records, one tier at a time: what shadow verification compares and
quarantines (`kvtier.engine.verify`, `kvtier.engine.segment_checks`).

A serving read walks the tiers and promotes what it finds (`StorageManager.get`); a
verification must see each tier's record of a chunk as that tier holds it, and remove a bad
one from that tier alone. `StorageManager.tier_records()` hands out one `TierRecords` per
attached tier, fastest first, so the engine never holds a tier itself: reads here promote
nothing, and removals are announced to the tier watch (a router learns that a quarantined
block is gone) as every other removal is.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.backends import StorageBackend
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj
from kvtier.storage.watch import TierWatch

__all__ = ["TierRecords"]


class TierRecords:
    """One tier's records (see the module docstring).

    Args:
        tier: the tier (behind its guard for a lower tier: failures are misses).
        watch: told of every removal.
        hot: whether this is the CPU tier (its copies may have been read from a lower one).
    """

    def __init__(self, tier: StorageBackend, watch: TierWatch, hot: bool):
        self._tier = tier
        self._watch = watch
        self.hot = hot

    @property
    def name(self) -> str:
        return self._tier.name

    def held(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading `keys` this tier holds."""
        return self._tier.batch_contains(keys)

    def first_held(self, keys: Sequence[ChunkKey]) -> int:
        """The index of the first of `keys` this tier holds, or -1."""
        return self._tier.first_held(keys)

    def read(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """This tier's records of the leading `keys` it holds (the caller owns them); nothing
        is promoted."""
        return self._tier.batch_get(keys)

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Delete `keys` from this tier alone (announced); how many it deleted."""
        removed = self._tier.remove(keys)
        self._watch.removed(self.name, [key.key for key in keys])
        return removed
