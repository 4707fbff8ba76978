"""Admission: which of the chunks a store offers the CPU tier takes, decided before the engine
allocates arena memory or copies a byte (`StorageManager.admit`).

Most chunks of production traffic are seen once (76% of the blocks of Mooncake's conversation
trace): storing them evicts chunks that would have been hit. `second_hit` remembers the keys it
was offered and the keys the CPU tier evicted (a ghost list of key strings, no data); when a
store would have to evict, it refuses a prefix whose first new chunk it has never seen, so a
one-off prompt does not push out what comes back. A prefix seen before (a conversation's next
turn, a document asked about again) is stored whole, new chunks included. While the arena has
room every chunk is stored, so a cache that is not full behaves as `always`.

`adaptive` is `second_hit` switched on and off by what the tier's evictions cost: it watches
how many offered prefixes start with a chunk the tier evicted lately. A tier too small for the
traffic's reuse distances (it evicts what comes back) refuses first-seen prefixes, so what it
holds stays long enough to be hit; a tier large enough stores everything, so a refused first
turn never costs a conversation's second. Mooncake's traces (docs/policies.md; a model of the
tier under lfuda, every prefix stored): the share of stored prefixes that return after an
eviction is 0.27-0.33 at 1M and 3M tokens and 0.02-0.17 at 0.1M and 10M, hence refusing
above 0.25 and storing again below 0.15.

Admission is a prefix decision: it returns how many leading chunks to store, never a hole.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import repeat

from kvtier.config.names import ADAPTIVE, ADMISSION_POLICIES, ALWAYS, SECOND_HIT
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey

__all__ = ["Admission", "AdmitAll", "AdaptiveSecondHit", "SecondHit", "make_admission",
           "GHOST_PER_CHUNK", "MAX_GHOST", "REFUSE_ABOVE", "STORE_BELOW"]

GHOST_PER_CHUNK = 4  # keys remembered per chunk the arena holds: reuse comes back that late
MAX_GHOST = 1 << 18  # at most this many keys (about 30 MB of strings and links)
# `adaptive`: the share of offered prefixes whose first chunk the tier evicted lately (an
# average over the last quarter-tier of offers) above which first-seen prefixes are refused,
# and below which they are stored again (apart, so the switch does not flap).
REFUSE_ABOVE = 0.25
STORE_BELOW = 0.15
ADAPTIVE_GHOST_PER_CHUNK = 8  # evicted keys remembered: a return is seen up to 8 tiers later


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


class AdaptiveSecondHit(Admission):
    """`second_hit` while the tier evicts what comes back (see the module docstring).

    Args:
        chunks: chunks the arena holds; the average's window is a quarter of it (at least
            64 offers), the lists of keys eight times it (at most `MAX_GHOST` each).
    """

    name = ADAPTIVE

    def __init__(self, chunks: int):
        self._capacity = min(MAX_GHOST, ADAPTIVE_GHOST_PER_CHUNK * max(1, chunks))
        # Offered lately: what a refusal calls known. Unlike `second_hit`, a key evicted but no
        # longer among the offered is first seen (storing those measured 1.205x against 1.333x
        # LRU on the synthetic trace at 0.1M tokens, 1.076x against 1.112x at 1M).
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._gone: OrderedDict[str, None] = OrderedDict()  # evicted lately
        # Evictions come one allocation at a time: queued without the lock (a deque's extend is
        # atomic) and moved into `_gone` by the next admit. The list's contents when read are
        # those of applying each at once (the newest `_capacity` keys either way).
        self._evicted: deque[ChunkKey] = deque()
        self._weight = 1.0 / max(64, chunks // 4)
        self._returns = 0.0  # the average share of offers that start with an evicted chunk
        self.refusing = False
        self._lock = threading.Lock()
        self.refused = 0  # chunks

    def admit(self, keys: Sequence[ChunkKey], fits: Callable[[], bool]) -> int:
        if not keys:
            return 0
        with self._lock:
            self._apply_evicted()
            first = keys[0].key
            returned = self._gone.pop(first, 0) is None
            self._returns += self._weight * (returned - self._returns)
            if self.refusing and self._returns < STORE_BELOW:
                self.refusing = False
            elif not self.refusing and self._returns > REFUSE_ABOVE:
                self.refusing = True
            refusing, known = self.refusing, first in self._seen
            _remember(self._seen, keys, self._capacity)
        if not refusing or known or fits():
            return len(keys)
        with self._lock:
            self.refused += len(keys)
            return 0

    def evicted(self, keys: Sequence[ChunkKey]) -> None:
        self._evicted.extend(keys)

    def _apply_evicted(self) -> None:
        """Move the queued evictions into `_gone` (under the lock: only its holder takes)."""
        queued = self._evicted
        if queued:
            gone, move = self._gone, self._gone.move_to_end
            while queued:
                name = queued.popleft().key
                if name in gone:
                    move(name)
                else:
                    gone[name] = None
            _trim(gone, self._capacity)

    def stats(self) -> dict[str, float]:
        with self._lock:
            self._apply_evicted()
        return {"admission_refused_chunks": self.refused,
                "admission_ghost_keys": len(self._seen) + len(self._gone),
                "admission_refusing": int(self.refusing)}


def _remember(ghost: OrderedDict[str, None], keys: Sequence[ChunkKey], capacity: int) -> None:
    move = ghost.move_to_end
    for k in keys:
        name = k.key
        if name in ghost:  # a move only where needed: most keys offered are new
            move(name)
        else:
            ghost[name] = None
    _trim(ghost, capacity)


def _trim(ghost: OrderedDict[str, None], capacity: int) -> None:
    """Forget the oldest keys over `capacity` (the pops looped in C: one a key added, once
    the list is full, on every store)."""
    if (over := len(ghost) - capacity) > 0:
        deque(map(ghost.popitem, repeat(False, over)), 0)


def make_admission(name: str, arena_bytes: int, chunk_bytes: int) -> Admission:
    """The admission policy called `name` for an arena of `arena_bytes` holding chunks of
    `chunk_bytes`; `ConfigError` listing the valid names if unknown."""
    if name == ALWAYS:
        return AdmitAll()
    chunks = max(1, arena_bytes // max(1, chunk_bytes))
    if name == SECOND_HIT:
        return SecondHit(min(MAX_GHOST, GHOST_PER_CHUNK * chunks))
    if name == ADAPTIVE:
        return AdaptiveSecondHit(chunks)
    raise ConfigError(f"admission_policy: must be one of {list(ADMISSION_POLICIES)}, "
                      f"got {name!r}")
