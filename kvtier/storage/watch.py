"""Who holds what: the chunks a tier gains and loses, told to whoever watches.

SGLang's KV events are the first watcher (`kvtier.integration.sglang.tier_events`): a router
that knows which server's tiers hold a prefix can send its next request there. With nobody
watching, a change costs one truth test.

A watcher is called on the thread that made the change (a store, the arena's evictor, a tier's
writer), with the tier's name, the chunks in prefix order and whether the tier now holds them.
It must not block: it queues what it needs and returns. A watcher that raises is logged
(rate-limited) and the change goes on: a cache never fails a store for a watcher.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvtier.keys import ChunkKey
from kvtier.metrics import RateLimitedLog

__all__ = ["TierWatch", "Watcher"]

logger = logging.getLogger(__name__)

# (tier name, chunks in prefix order, whether the tier now holds them)
Watcher = Callable[[str, Sequence[ChunkKey], bool], None]


class TierWatch:
    """The watchers of one storage manager's tiers. `add` before serving; the calls are
    thread-safe (the list is replaced, never changed in place)."""

    def __init__(self) -> None:
        self._watchers: tuple[Watcher, ...] = ()
        self._warn = RateLimitedLog(logger)

    def add(self, watcher: Watcher) -> None:
        self._watchers = (*self._watchers, watcher)

    def stored(self, tier: str, keys: Sequence[ChunkKey]) -> None:
        """Tier `tier` now holds `keys`."""
        if self._watchers and keys:
            self._tell(tier, keys, True)

    def removed(self, tier: str, keys: Sequence[ChunkKey]) -> None:
        """Tier `tier` no longer holds `keys`."""
        if self._watchers and keys:
            self._tell(tier, keys, False)

    def _tell(self, tier: str, keys: Sequence[ChunkKey], held: bool) -> None:
        for watcher in self._watchers:
            try:
                watcher(tier, keys, held)
            except Exception as exc:  # a watcher never fails the change it watches
                self._warn.warning("watcher", "kvtier: a tier watcher failed on %d chunks of "
                                   "%s: %r", len(keys), tier, exc)
