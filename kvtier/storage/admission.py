"""Admission: which of the chunks a store offers the CPU tier takes, decided before the engine
allocates arena memory or copies a byte (`StorageManager.admit`).

Most chunks of production traffic are seen once (76% of the blocks of Mooncake's conversation
trace): storing them evicts chunks that would have been hit. `second_hit` remembers the keys it
was offered and the keys the CPU tier evicted (a ghost list of key strings, no data); when a
store would have to evict, it refuses a prefix whose first new chunk it has never seen, so a
one-off prompt does not push out what comes back. A prefix seen before (a conversation's next
turn, a document asked about again) is stored whole, new chunks included. While the arena has
room every chunk is stored, so a cache that is not full behaves as `always`.

Admission is a prefix decision: it returns how many leading chunks to store, never a hole.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.config.names import ADMISSION_POLICIES, ALWAYS, SECOND_HIT
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey

__all__ = ["Admission", "AdmitAll", "SecondHit", "make_admission", "GHOST_PER_CHUNK",
           "MAX_GHOST"]

GHOST_PER_CHUNK = 4  # keys remembered per chunk the arena holds: reuse comes back that late
MAX_GHOST = 1 << 18  # at most this many keys (about 30 MB of strings and links)


class Admission(ABC):
    """Decides, per store, how many of the chunks the CPU tier lacks it takes."""

    name: str = "?"

    @abstractmethod
    def admit(self, keys: Sequence[ChunkKey], fits: Callable[[], bool]) -> int:
        """How many leading `keys` (the chunks a store would add, in order) to store.

        `fits()`: whether the arena has room for all of them without evicting (it walks the
        arena: asked only when the answer matters). Never raises."""

    def evicted(self, keys: Sequence[ChunkKey]) -> None:  # noqa: B027 - nothing to learn
        """The CPU tier let go of `keys`: a later offer of one of them is a return."""

    def stats(self) -> dict[str, float]:
        return {}


class AdmitAll(Admission):
    """Stores everything offered (kvtier's behaviour before admission policies)."""

    name = ALWAYS

    def admit(self, keys: Sequence[ChunkKey], fits: Callable[[], bool]) -> int:
        return len(keys)


class SecondHit(Admission):
    """Refuses first-seen prefixes when storing them would evict (see the module docstring).

    Args:
        capacity: keys remembered, at most; the least recently offered go first.
    """

    name = SECOND_HIT

    def __init__(self, capacity: int):
        self._capacity = max(1, capacity)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # stores arrive from the engine's threads
        self.refused = 0  # chunks

    def admit(self, keys: Sequence[ChunkKey], fits: Callable[[], bool]) -> int:
        if not keys:
            return 0
        with self._lock:
            known = keys[0].key in self._seen
            self._remember(keys)
        if known or fits():
            return len(keys)
        with self._lock:
            self.refused += len(keys)
            return 0

    def evicted(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            self._remember(keys)

    def _remember(self, keys: Sequence[ChunkKey]) -> None:
        seen = self._seen
        for k in keys:
            seen[k.key] = None
            seen.move_to_end(k.key)
        while len(seen) > self._capacity:
            seen.popitem(last=False)

    def stats(self) -> dict[str, float]:
        return {"admission_refused_chunks": self.refused, "admission_ghost_keys": len(self._seen)}


def make_admission(name: str, arena_bytes: int, chunk_bytes: int) -> Admission:
    """The admission policy called `name` for an arena of `arena_bytes` holding chunks of
    `chunk_bytes`; `ConfigError` listing the valid names if unknown."""
    if name == ALWAYS:
        return AdmitAll()
    if name == SECOND_HIT:
        chunks = max(1, arena_bytes // max(1, chunk_bytes))
        return SecondHit(min(MAX_GHOST, GHOST_PER_CHUNK * chunks))
    raise ConfigError(f"admission_policy: must be one of {list(ADMISSION_POLICIES)}, "
                      f"got {name!r}")
