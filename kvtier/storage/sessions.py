"""Session pins: a conversation's prefix stays in the CPU tier between its turns.

A streaming session (a chat, an agent loop) comes back with its whole history plus a little
more; if concurrent traffic evicted that history meanwhile, the next turn recomputes it. A
session's latest stored prefix is therefore pinned in the CPU tier (exempt from eviction) until
the session is released or has been idle for `session_ttl_secs`, within two bounds:

- Per session: one session pins at most `SESSION_SHARE` (a quarter) of the pin cap, its leading
  chunks; the deeper chunks of a longer prefix stay cached as ordinary LRU data. A session's
  long prompt is trimmed first, and never unpins another session's chunks beyond that quota.
- All sessions together pin at most the cap, `max_session_pinned_fraction` of the CPU tier,
  itself never more than `MAX_PINNED_FRACTION` of it. When sessions, each within its quota,
  fill the cap, the least recently used sessions are unpinned first.

A prefix can also be *retained* (a lifecycle hint, `kvtier.engine.hints`): pinned under a
name for a fixed time from its store, not an idle time, within the same quota; when pins pass
the cap, sessions are unpinned first, then retained prefixes, the soonest to expire first.

Tenants (a pin's salt, SGLang's `cache_salt`) share the cap as they share the tier
(`tenant_max_fraction`): while two or more hold pins, the cap unpins, in the order above, the
pins of tenants holding more than their share of it first, so one tenant's flood of sessions or
retain hints cannot unpin another tenant's pins while that tenant is within its share.

So pins never take more than the cap: at least 1 - `max_session_pinned_fraction` (at least a
fifth) of the CPU tier stays evictable for stores and prefetches, and what is unpinned becomes
ordinary LRU data. A store larger than that headroom (plus memory other work holds) can still
fall short, as it would without sessions on a tier that small.

Chunk sizes are learned from the tier (`pinned_bytes` before and after pinning a chunk no session
pins yet): every pin of the tier goes through this object under its lock, so the difference is
that chunk's size (a pinned chunk removed from the tier at that instant skews one measurement,
which only mis-charges a quota, never the cap: the cap is checked on the tier's own count). A
session is charged the full size of every chunk it pins, shared with other sessions or not.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvtier.backends.base import HotTier
from kvtier.keys import ChunkKey
from kvtier.metrics import Counters

__all__ = ["SessionPins", "session_tag", "MAX_PINNED_FRACTION", "SESSION_SHARE"]

logger = logging.getLogger(__name__)

# Of the CPU tier, the most all sessions may pin: the rest stays evictable, so stores and
# prefetches always have room. Config validation refuses more; SessionPins clamps to it too.
MAX_PINNED_FRACTION = 0.8
# Of the pin cap, the most one session may pin: at least four sessions at their full quota fit
# together before any of them is unpinned for another.
SESSION_SHARE = 0.25


def session_tag(session_id: str) -> str:
    """How a session is named in logs: the first 12 hex digits of SHA-256(session_id).

    A session id is a bearer handle (whoever has it can continue the conversation), so it is
    never logged; the tag still tells one session's lines from another's, and an operator who
    holds an id can compute its tag to find them.
    """
    # surrogatepass: an id decoded from JSON may hold a lone surrogate; logging must not raise
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:12]


@dataclass
class _Pinned:
    keys: list[ChunkKey]  # the pinned leading chunks of the session's latest prefix, in order
    nbytes: int  # what they are charged against the session's quota
    used: float  # last use (clock seconds)


class SessionPins:
    """Pins per session over one CPU tier. Thread-safe.

    Args:
        cpu: the tier whose chunks are pinned; only this object pins it.
        cap_bytes: most bytes all sessions may pin together.
        ttl_s: a session idle this long is unpinned (at the next call into this object).
        counters: where unpins by reason are counted.
        clock: monotonic seconds (tests pass their own).
        arena_bytes: the CPU tier's size; when given, the cap is clamped to
            `MAX_PINNED_FRACTION` of it (config validation already refuses a larger fraction).
        session_share: the fraction of the cap one session may pin, in (0, 1].
        tenant_share: the fraction of the cap one tenant may keep against others, in (0, 1]
            (`tenant_max_fraction`; 1: tenants are not told apart).
    """

    def __init__(self, cpu: HotTier, cap_bytes: int, ttl_s: float, counters: Counters,
                 clock: Callable[[], float] = time.monotonic, *, arena_bytes: int | None = None,
                 session_share: float = SESSION_SHARE, tenant_share: float = 1.0):
        if arena_bytes is not None:
            cap_bytes = min(cap_bytes, int(MAX_PINNED_FRACTION * arena_bytes))
        self._cpu = cpu
        self._cap = max(0, cap_bytes)
        self._quota = int(self._cap * min(max(session_share, 0.0), 1.0))
        self._tenant_cap = self._cap * min(max(tenant_share, 0.0), 1.0)
        self._ttl = ttl_s
        self._counters = counters
        counters.declare("session_releases", "session_unpins_ttl", "session_unpins_cap",
                         "session_unpins_quota", "retain_expiries")
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, _Pinned] = OrderedDict()  # least recently used first
        self._retained: dict[str, _Pinned] = {}  # name -> pins; `used` is when they expire
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries skipped when popped
        self._holders: Counter[str] = Counter()  # chunk key -> sessions pinning it
        self._sizes: dict[str, int] = {}  # chunk key -> its bytes, while a session pins it

    @property
    def cap_bytes(self) -> int:
        """Most bytes all sessions pin together."""
        return self._cap

    @property
    def quota_bytes(self) -> int:
        """Most bytes one session pins."""
        return self._quota

    def pin(self, session_id: str, keys: Sequence[ChunkKey]) -> int:
        """Make the leading `keys` (the session's latest prefix, in order) the session's pins,
        replacing the previous turn's; returns how many chunks are pinned.

        Pins the chunks the tier holds, up to the session's quota; deeper chunks are left
        unpinned (the session's own, never another's). Then, if all pins pass the cap, other
        sessions are unpinned, least recently used first.
        """
        with self._lock:
            self._expire_locked()
            # The new turn is pinned before the old one is unpinned: the chunks they share are
            # never evictable in between.
            held, nbytes, over = self._pin_within_locked(keys, self._quota)
            old = self._sessions.pop(session_id, None)
            if old is not None:
                self._unpin_locked(old.keys)
            if over:
                self._counters.inc("session_unpins_quota")
                logger.debug("kvtier: session %s pins more than its quota (%d bytes): kept its "
                             "first %d chunks pinned", session_tag(session_id), self._quota,
                             len(held))
            self._sessions[session_id] = _Pinned(held, nbytes, self._clock())
            self._enforce_cap_locked(session_id)
            return len(self._sessions[session_id].keys)

    def retain(self, name: str, keys: Sequence[ChunkKey], ttl_s: float) -> int:
        """Pin the leading `keys` under `name` for `ttl_s` seconds from now, replacing what
        `name` pinned before (its clock restarts); returns how many chunks are pinned. The
        same quota as a session's; see the module docstring for the cap."""
        with self._lock:
            self._expire_locked()
            held, nbytes, _ = self._pin_within_locked(keys, self._quota)
            old = self._retained.pop(name, None)
            if old is not None:
                self._unpin_locked(old.keys)
            until = self._clock() + ttl_s
            self._retained[name] = _Pinned(held, nbytes, until)
            heapq.heappush(self._deadlines, (until, name))
            if len(self._deadlines) > 2 * len(self._retained) + 1024:  # drop the stale ones
                self._deadlines = [(e.used, n) for n, e in self._retained.items()]
                heapq.heapify(self._deadlines)
            self._enforce_cap_locked(name, self._retained)
            return len(self._retained[name].keys)

    def touch(self, session_id: str) -> None:
        """The session was used: restart its idle clock."""
        with self._lock:
            entry = self._sessions.pop(session_id, None)
            if entry is not None:
                entry.used = self._clock()
                self._sessions[session_id] = entry
            self._expire_locked()

    def release(self, session_id: str) -> bool:
        """Unpin the session (it ended); False if it held no pins."""
        with self._lock:
            entry = self._sessions.pop(session_id, None)
            if entry is None:
                return False
            self._unpin_locked(entry.keys)
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
                    "retained_prefixes": len(self._retained),
                    "session_pinned_bytes": self._cpu.pinned_bytes,
                    "session_pinned_cap_bytes": self._cap}

    def close(self) -> None:
        with self._lock:
            for entry in [*self._sessions.values(), *self._retained.values()]:
                self._unpin_locked(entry.keys)
            self._sessions.clear()
            self._retained.clear()

    def _pin_within_locked(self, keys: Sequence[ChunkKey],
                           budget: int) -> tuple[list[ChunkKey], int, bool]:
        """Pin the leading `keys` the tier holds while their sizes sum to at most `budget`;
        returns them, their bytes, and whether the budget (not a miss) stopped it."""
        held: list[ChunkKey] = []
        total = 0
        for key in keys:
            size = self._sizes.get(key.key)
            if size is None:  # no session pins it: pinning it adds exactly its size
                before = self._cpu.pinned_bytes
                if not self._cpu.pin([key]):
                    return held, total, False
                size = max(0, self._cpu.pinned_bytes - before)
                if total + size > budget:
                    self._cpu.unpin([key])
                    return held, total, True
                self._sizes[key.key] = size
            elif total + size > budget:
                return held, total, True
            elif not self._cpu.pin([key]):  # pinned by a session, yet the tier lost it
                return held, total, False
            self._holders[key.key] += 1
            held.append(key)
            total += size
        return held, total, False

    def _unpin_locked(self, keys: Sequence[ChunkKey]) -> None:
        self._cpu.unpin(keys)
        for key in keys:
            left = self._holders[key.key] - 1
            if left > 0:
                self._holders[key.key] = left
            else:
                del self._holders[key.key]
                self._sizes.pop(key.key, None)

    def _expire_locked(self) -> None:
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            until, name = heapq.heappop(self._deadlines)
            entry = self._retained.get(name)
            if entry is not None and entry.used == until:  # not retained again since
                del self._retained[name]
                self._unpin_locked(entry.keys)
                self._counters.inc("retain_expiries")
        deadline = now - self._ttl
        while self._sessions:
            sid, entry = next(iter(self._sessions.items()))
            if entry.used > deadline:
                break
            del self._sessions[sid]
            self._unpin_locked(entry.keys)
            self._counters.inc("session_unpins_ttl")
            logger.debug("kvtier: session %s idle for %.0fs: unpinned", session_tag(sid),
                         self._ttl)

    def _enforce_cap_locked(self, current: str, own: dict[str, _Pinned] | None = None) -> None:
        """Unpin whole sessions, least recently used first, then retained prefixes, the soonest
        to expire first, while all pins pass the cap; `current` (of table `own`, the sessions
        by default) last, and then only its deepest chunks (a safety net: within its quota it
        fits under the cap alone)."""
        own = self._sessions if own is None else own
        if self._cpu.pinned_bytes <= self._cap:
            return
        for table, name in self._cap_victims(current, own):
            if self._cpu.pinned_bytes <= self._cap:
                return
            self._unpin_locked(table.pop(name).keys)
            self._counters.inc("session_unpins_cap")
            logger.debug("kvtier: pins reached max_session_pinned_fraction of the CPU tier: "
                         "unpinned %s", f"session {session_tag(name)}" if table is self._sessions
                         else "a retained prefix")
        entry = own[current]
        while entry.keys and self._cpu.pinned_bytes > self._cap:
            last = entry.keys.pop()
            entry.nbytes -= self._sizes.get(last.key, 0)
            self._unpin_locked([last])

    def _cap_victims(self, current: str, own: dict[str, _Pinned],
                     ) -> Iterator[tuple[dict[str, _Pinned], str]]:
        """What the cap unpins, in order: pins of tenants over their share of the cap first
        (while they are over it), then the rest, each in `_victims_in_order`'s order."""
        ordered = self._victims_in_order(current, own)
        held: Counter[str] = Counter()
        for entry in (*self._sessions.values(), *self._retained.values()):
            held[_tenant(entry)] += entry.nbytes
        if self._tenant_cap >= self._cap or len(held) < 2:
            yield from ordered
            return
        later = []
        for table, name in ordered:
            tenant = _tenant(table[name])
            if held[tenant] > self._tenant_cap:
                held[tenant] -= table[name].nbytes
                yield table, name
            else:
                later.append((table, name))
        yield from ((t, n) for t, n in later if n in t)

    def _victims_in_order(self, current: str, own: dict[str, _Pinned],
                          ) -> Iterator[tuple[dict[str, _Pinned], str]]:
        """Sessions, least recently used first, then retained prefixes, the soonest to expire
        first (lazily: the retained are sorted only if reached); never `current`."""
        yield from ((self._sessions, s) for s in list(self._sessions)
                    if not (own is self._sessions and s == current))
        yield from ((self._retained, n) for _, n in sorted(
            (e.used, n) for n, e in self._retained.items()
            if not (own is self._retained and n == current)))


def _tenant(entry: _Pinned) -> str:
    """The tenant a pin belongs to: its chunks' salt."""
    return entry.keys[0].salt if entry.keys else ""
