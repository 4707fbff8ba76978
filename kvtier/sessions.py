"""Session pins: a conversation's prefix stays in the CPU tier between its turns.

A streaming session (a chat, an agent loop) comes back with its whole history plus a little
more; if concurrent traffic evicted that history meanwhile, the next turn recomputes it. A
session's latest stored prefix is therefore pinned in the CPU tier (exempt from eviction) until
the session is released, has been idle for `session_ttl_secs`, or the pinned total would pass
`max_session_pinned_fraction` of the CPU tier: then the least recently used sessions are
unpinned first, and a single session larger than the cap keeps only the leading chunks that
fit. Pins never make an allocation fail: what is unpinned becomes ordinary LRU data.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.backends.base import HotTier
from kvtier.keys import ChunkKey
from kvtier.metrics import Counters

__all__ = ["SessionPins", "session_tag"]

logger = logging.getLogger(__name__)


def session_tag(session_id: str) -> str:
    """How a session is named in logs: the first 12 hex digits of SHA-256(session_id).

    A session id is a bearer handle (whoever has it can continue the conversation), so it is
    never logged; the tag still tells one session's lines from another's, and an operator who
    holds an id can compute its tag to find them.
    """
    # surrogatepass: an id decoded from JSON may hold a lone surrogate; logging must not raise
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:12]


class SessionPins:
    """Pins per session over one CPU tier. Thread-safe.

    Args:
        cpu: the tier whose chunks are pinned.
        cap_bytes: most bytes all sessions may pin together.
        ttl_s: a session idle this long is unpinned (at the next call into this object).
        counters: where unpins by reason are counted.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, cpu: HotTier, cap_bytes: int, ttl_s: float, counters: Counters,
                 clock: Callable[[], float] = time.monotonic):
        self._cpu = cpu
        self._cap = cap_bytes
        self._ttl = ttl_s
        self._counters = counters
        counters.declare("session_releases", "session_unpins_ttl", "session_unpins_cap")
        self._clock = clock
        self._lock = threading.Lock()
        # session id -> (pinned keys in prefix order, last use); least recently used first
        self._sessions: OrderedDict[str, tuple[list[ChunkKey], float]] = OrderedDict()

    def pin(self, session_id: str, keys: Sequence[ChunkKey]) -> int:
        """Make `keys` (the session's latest prefix, in order) the session's pins, replacing
        the previous turn's; returns how many chunks are pinned."""
        with self._lock:
            self._expire_locked()
            n = self._cpu.pin(keys)
            old = self._sessions.pop(session_id, None)
            if old is not None:
                self._cpu.unpin(old[0])
            self._sessions[session_id] = (list(keys[:n]), self._clock())
            self._enforce_cap_locked(session_id)
            return len(self._sessions[session_id][0]) if session_id in self._sessions else 0

    def touch(self, session_id: str) -> None:
        """The session was used: restart its idle clock."""
        with self._lock:
            entry = self._sessions.pop(session_id, None)
            if entry is not None:
                self._sessions[session_id] = (entry[0], self._clock())
            self._expire_locked()

    def release(self, session_id: str) -> bool:
        """Unpin the session (it ended); False if it held no pins."""
        with self._lock:
            entry = self._sessions.pop(session_id, None)
            if entry is None:
                return False
            self._cpu.unpin(entry[0])
            self._counters.inc("session_releases")
            return True

    def expire(self) -> None:
        """Unpin sessions idle longer than the TTL."""
        with self._lock:
            self._expire_locked()

    def stats(self) -> dict[str, float]:
        with self._lock:
            self._expire_locked()
            return {"sessions_pinned": len(self._sessions),
                    "session_pinned_bytes": self._cpu.pinned_bytes,
                    "session_pinned_cap_bytes": self._cap}

    def close(self) -> None:
        with self._lock:
            for keys, _ in self._sessions.values():
                self._cpu.unpin(keys)
            self._sessions.clear()

    def _expire_locked(self) -> None:
        deadline = self._clock() - self._ttl
        while self._sessions:
            sid, (keys, used) = next(iter(self._sessions.items()))
            if used > deadline:
                break
            del self._sessions[sid]
            self._cpu.unpin(keys)
            self._counters.inc("session_unpins_ttl")
            logger.debug("kvtier: session %s idle for %.0fs: unpinned", session_tag(sid),
                         self._ttl)

    def _enforce_cap_locked(self, current: str) -> None:
        for sid in [s for s in self._sessions if s != current]:  # least recently used first
            if self._cpu.pinned_bytes <= self._cap:
                return
            keys, _ = self._sessions.pop(sid)
            self._cpu.unpin(keys)
            self._counters.inc("session_unpins_cap")
        keys, used = self._sessions[current]
        dropped = 0
        while keys and self._cpu.pinned_bytes > self._cap:  # trim the session's own tail
            self._cpu.unpin([keys.pop()])
            dropped += 1
        if dropped:
            self._counters.inc("session_unpins_cap")
            logger.info("kvtier: session %s pins more than max_session_pinned_fraction of the "
                        "CPU tier; kept its first %d chunks pinned", session_tag(current),
                        len(keys))
        self._sessions[current] = (keys, used)
