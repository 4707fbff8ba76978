"""Where the CPU tier's copy of a chunk came from: the lower tier a read promoted it from, or
the CPU tier itself (a chunk this process stored).

Shadow verification by the tail needs it to blame by source: a CPU copy of a forged Redis
record is Redis's record, not evidence against a prefix the CPU tier computed itself
(`engine/verify.py`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.keys import ChunkKey

__all__ = ["Origins"]

# Chunks remembered, about 100 bytes each; the oldest are forgotten first, and a forgotten
# chunk counts as the CPU tier's own.
MAX_ORIGINS = 1 << 16


class Origins:
    """The lower tier each promoted chunk of the CPU tier was read from. Thread-safe.

    Entries outlive the CPU tier's copy on purpose: a staging tier (`local_cpu: false`) lets a
    chunk go once delivered, and the request it was delivered to is verified later.
    """

    def __init__(self, capacity: int = MAX_ORIGINS):
        self._capacity = capacity
        self._lock = threading.Lock()
        self._tiers: OrderedDict[str, str] = OrderedDict()  # chunk -> the tier read

    def promoted(self, key: ChunkKey, tier: str) -> None:
        """The CPU tier's copy of `key` is now tier `tier`'s record of it."""
        with self._lock:
            self._tiers[key.key] = tier
            self._tiers.move_to_end(key.key)
            if len(self._tiers) > self._capacity:
                self._tiers.popitem(last=False)

    def stored(self, keys: Sequence[ChunkKey]) -> None:
        """The CPU tier's copies of `keys` are this process's own (a put replaces a copy)."""
        if not self._tiers:  # no promotion yet: the common case on a put, lock-free
            return
        with self._lock:
            for key in keys:
                self._tiers.pop(key.key, None)

    def of(self, key: ChunkKey, own: str) -> str:
        """The tier the CPU tier's copy of `key` was read from, else `own` (the CPU tier's name:
        stored here, or not remembered)."""
        with self._lock:
            return self._tiers.get(key.key, own)
