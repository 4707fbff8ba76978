"""What a lower tier was seen to hold, remembered briefly: a repeated prefix asks no round trip.

A far tier's `contains` costs a round trip, and on the admission path a request waits for it.
Requests repeat prefixes within seconds (a conversation's turns, a shared system prompt), so
each chunk's last answer, present or absent, is kept for `EXISTENCE_TTL_S`, at most
`MAX_ENTRIES` chunks (the oldest go first). This process's own writes and removals forget the
chunks they touch, and a read that misses a chunk remembered as present forgets it, so a stale
answer costs at most one wasted read (present) or one lost hit for a few seconds (absent:
another instance wrote it meanwhile). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.keys import ChunkKey

__all__ = ["Existence", "EXISTENCE_TTL_S", "MAX_ENTRIES"]

EXISTENCE_TTL_S = 5.0
MAX_ENTRIES = 65536  # ~100 bytes each: a few MB, and far more chunks than a few seconds ask for


class Existence:
    """Recent `contains` answers of one tier, by chunk key."""

    def __init__(self, ttl_s: float = EXISTENCE_TTL_S, max_entries: int = MAX_ENTRIES):
        if ttl_s < 0 or max_entries < 1:
            raise ValueError(f"ttl_s must be >= 0 and max_entries >= 1, got {ttl_s}, "
                             f"{max_entries}")
        self._ttl = ttl_s
        self._max = max_entries
        self._seen: OrderedDict[str, tuple[bool, float]] = OrderedDict()  # key -> (held, until)
        self._lock = threading.Lock()

    def leading(self, keys: Sequence[ChunkKey], now: float | None = None) -> tuple[int, bool]:
        """(n, answered): the first `n` keys are remembered as held; `answered` when key `n`
        is remembered as absent (or `n` is all of them), so the tier need not be asked.
        Otherwise the tier must be asked from key `n` on."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for n, key in enumerate(keys):
                seen = self._seen.get(key.key)
                if seen is None or seen[1] <= now:
                    return n, False
                if not seen[0]:
                    return n, True
        return len(keys), True

    def remember(self, keys: Sequence[ChunkKey], held: int) -> None:
        """The tier answered that it holds the first `held` of `keys` and not the next one."""
        until = time.monotonic() + self._ttl
        answers = [(k.key, True) for k in keys[:held]]
        if held < len(keys):
            answers.append((keys[held].key, False))
        with self._lock:
            for name, present in answers:
                self._seen[name] = (present, until)
                self._seen.move_to_end(name)
            while len(self._seen) > self._max:
                self._seen.popitem(last=False)

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Drop what is remembered of `keys` (they were written, removed or found missing)."""
        with self._lock:
            for key in keys:
                self._seen.pop(key.key, None)

    def __len__(self) -> int:
        return len(self._seen)
