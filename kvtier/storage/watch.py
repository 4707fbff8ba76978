"""Who holds what: the chunks a tier gains and loses, told to whoever watches.

SGLang's KV events are the first watcher (`kvtier.integration.sglang.rank.tier_events`): a router
that knows which server's tiers hold a prefix can send its next request there. With nobody
watching, a change costs one truth test.

A watcher is called on the thread that made the change (a store, the arena's evictor, a tier's
writer, a tier evicting on its own under its lock), with the tier's name and the chunks: the
keys a tier gained, in prefix order, or the key strings of those it lost (a tier that drops a
record on its own may know no more of it than its key string). It must not block: it queues
what it needs and returns. A watcher that raises is logged (rate-limited) and the change goes
on: a cache never fails a store for a watcher.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from kvtier.keys import ChunkKey
from kvtier.metrics import RateLimitedLog

__all__ = ["TierWatch", "Watcher"]

logger = logging.getLogger(__name__)


class Watcher(Protocol):
    """Told what each tier gains and loses (see the module's contract)."""

    def stored(self, tier: str, keys: Sequence[ChunkKey]) -> None:
        """Tier `tier` now holds `keys` (prefix order)."""

    def removed(self, tier: str, keys: Sequence[str]) -> None:
        """Tier `tier` no longer holds the chunks of these key strings."""


class TierWatch:
    """The watchers of one storage manager's tiers. `add` before serving; the calls are
    thread-safe (the list is replaced, never changed in place)."""

    def __init__(self) -> None:
        self._watchers: tuple[Watcher, ...] = ()
        self._warn = RateLimitedLog(logger)

    def add(self, watcher: Watcher) -> None:
        self._watchers = (*self._watchers, watcher)

    @property
    def watching(self) -> bool:
        """Whether anybody is told: a tier keeps what a removal needs only while so."""
        return bool(self._watchers)

    def stored(self, tier: str, keys: Sequence[ChunkKey]) -> None:
        """Tier `tier` now holds `keys`."""
        if self._watchers and keys:
            self._tell(tier, len(keys), lambda w: w.stored(tier, keys))

    def removed(self, tier: str, keys: Sequence[str]) -> None:
        """Tier `tier` no longer holds the chunks of key strings `keys`."""
        if self._watchers and keys:
            self._tell(tier, len(keys), lambda w: w.removed(tier, keys))

    def _tell(self, tier: str, n: int, call: Callable[[Watcher], None]) -> None:
        for watcher in self._watchers:
            try:
                call(watcher)
            except Exception as exc:  # a watcher never fails the change it watches
                self._warn.warning("watcher", "kvtier: a tier watcher failed on %d chunks of "
                                   "%s: %r", n, tier, exc)
