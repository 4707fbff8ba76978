"""`CacheEngine.tiers`: the engine's lower tiers while it serves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.config import Config
from kvtier.storage import StorageManager
from kvtier.storage.watch import Watcher

if TYPE_CHECKING:
    from kvtier.storage.guard import GuardedTier
    from kvtier.storage.writer import TierWriter

__all__ = ["TierControl"]


class TierControl:
    """Attach and detach lower tiers (`disk`, `redis`, any row of the tier table) while
    stores and loads run: in one call, or in two halves (`build`, then `publish` or
    `discard`) so that a server builds a tier (connect, index: seconds) off its serving
    thread and publishes it there. What each call guarantees: `StorageManager.attach_tier`
    and friends."""

    def __init__(self, storage: StorageManager):
        self._storage = storage

    @property
    def names(self) -> list[str]:
        """The attached tiers' names, fastest first (the CPU or staging tier first)."""
        return [t.name for t in self._storage.tiers]

    def attach(self, name: str, config: Config | None = None) -> None:
        """Build lower tier `name` from `config` (default the engine's) and serve from it."""
        self._storage.attach_tier(name, config)

    def detach(self, name: str, *, drain: bool = True, wait: bool = True) -> None:
        """Stop serving from lower tier `name`, write (`drain`) or drop its queued writes,
        and close it (on a background thread without `wait`)."""
        self._storage.detach_tier(name, drain=drain, wait=wait)

    def build(self, name: str, config: Config | None = None,
              ) -> tuple[GuardedTier, TierWriter]:
        """The slow half of `attach`: the tier and its writer, built and probed, unpublished."""
        return self._storage.build_tier(name, config)

    def publish(self, tier: GuardedTier, writer: TierWriter) -> None:
        """Serve from a tier `build` returned."""
        self._storage.publish_tier(tier, writer)

    def watch(self, watcher: Watcher) -> None:
        """Tell `watcher` whenever a tier gains chunks (a store, a promotion, a lower tier's
        write) or loses some (an eviction, a purge): `stored(tier, keys)`,
        `removed(tier, key strings)`, on the thread that made the change, so it must only
        queue (`kvtier.storage.watch`)."""
        self._storage.watch.add(watcher)

    def discard(self, tier: GuardedTier, writer: TierWriter) -> None:
        """Close a tier `build` returned without ever serving from it."""
        self._storage.discard_tier(tier, writer)
