"""`CacheEngine.tiers`: the engine's tiers while it serves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.keys import ChunkKey
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
    and friends. Also: chunks removed from the tiers (`remove`), the chunks a tenant holds in
    the CPU tier (`tenant_chunks`), and watchers of what each tier gains and loses."""

    def __init__(self, storage: StorageManager):
        self._storage = storage

    @property
    def names(self) -> list[str]:
        """The attached tiers' names, fastest first (the CPU or staging tier first)."""
        return [t.name for t in self._storage.tiers]

    def remove(self, keys: Sequence[ChunkKey], tier: str | None = None) -> dict[str, int]:
        """Delete the chunks `keys` from tier `tier` alone (the tiers after it keep them: what
        a restarted CPU tier, or a read from a slower tier, looks like), or from every tier;
        `{tier name: chunks deleted there}`, fastest first. Watchers are told (`watch`).

        Raises:
            ValueError: `tier` is not attached (the message names those that are).
        """
        tiers = [t for t in self._storage.tiers if tier is None or t.name == tier]
        if not tiers:
            raise ValueError(f"tier: {tier!r} is not attached; the tiers are {self.names}")
        counts = dict.fromkeys((t.name for t in tiers), 0)
        names = [key.key for key in keys]
        # Slowest first: a load running meanwhile cannot promote a chunk back into a faster
        # tier from a slower one not yet reached.
        for t in reversed(tiers):
            counts[t.name] = t.remove(keys)
            self._storage.watch.removed(t.name, names)
        return counts

    def tenant_chunks(self, salt: str) -> list[ChunkKey]:
        """The keys of the chunks tenant `salt` (a request's salt) holds in the CPU tier (or
        the staging tier of `local_cpu: false`), a snapshot: the tiers this process lists
        itself (a lower tier's records are listed by its inventory)."""
        hot = self._storage.hot
        inner = getattr(hot, "inner", hot)  # behind its failure guard
        return inner.keys_of(salt) if isinstance(inner, CPUBackend) else []

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
