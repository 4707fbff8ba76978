"""The live set of lower tiers and their writers, changed while stores and loads run.

Readers take the current lists (`tiers`, `writers`) without locking: a change publishes new
lists and never mutates old ones, so a call that started on the old set finishes on it (the
tier's guard counts such calls, so a detached tier is closed only after they end). Changes
(attach, detach, close) take the set's lock, so none of them loses another's.
"""

from __future__ import annotations

import threading

from kvtier.metrics import RateLimitedLog
from kvtier.names import TIERS
from kvtier.storage.guard import GuardedTier
from kvtier.storage.writer import TierWriter

__all__ = ["TierSet", "TIER_ORDER", "retire"]

TIER_ORDER = TIERS  # fastest first: the order puts and gets walk


class TierSet:
    def __init__(self) -> None:
        self.tiers: list[GuardedTier] = []
        self.writers: list[TierWriter] = []
        self._lock = threading.Lock()
        self._closed = False

    def find(self, name: str) -> GuardedTier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def add(self, tier: GuardedTier, writer: TierWriter) -> None:
        """Publish `tier` (in `TIER_ORDER`) and its writer; `ValueError` if attached or if the
        set is closed (the caller still owns both then)."""
        with self._lock:
            if self._closed:
                raise ValueError(f"tier {tier.name!r} cannot be attached: storage is closed")
            if self.find(tier.name) is not None:
                raise ValueError(f"tier {tier.name!r} is already attached")
            rank = {name: i for i, name in enumerate(TIER_ORDER)}
            self.tiers = sorted([*self.tiers, tier], key=lambda t: rank.get(t.name, 99))
            self.writers = [*self.writers, writer]

    def remove(self, name: str) -> tuple[GuardedTier, TierWriter]:
        """Unpublish tier `name`; returns it and its writer. `ValueError` if not attached."""
        with self._lock:
            tier = self.find(name)
            if tier is None:
                raise ValueError(f"tier {name!r} is not attached; attached: "
                                 f"{[t.name for t in self.tiers]}")
            writer = next(w for w in self.writers if w.backend is tier)
            self.tiers = [t for t in self.tiers if t is not tier]
            self.writers = [w for w in self.writers if w is not writer]
            return tier, writer

    def close(self) -> tuple[list[GuardedTier], list[TierWriter]]:
        """Unpublish every tier and writer and refuse later `add`s; returns what was attached,
        for the caller to close (no tier is closed while still published)."""
        with self._lock:
            self._closed = True
            tiers, writers = self.tiers, self.writers
            self.tiers, self.writers = [], []
            return tiers, writers


def retire(tier: GuardedTier, writer: TierWriter, *, drain: bool, timeout: float,
           warn: RateLimitedLog) -> None:
    """Close a detached tier: its queued writes written (`drain`) or dropped and counted, the
    calls still running on it given up to `timeout` seconds to finish."""
    if drain:
        writer.close(timeout)
    else:
        writer.cancel(timeout)
    if not tier.wait_idle(timeout):
        warn.warning(f"detach-{tier.name}", "kvtier: calls on tier %s still running after "
                     "%.1fs; closing it under them", tier.name, timeout)
    tier.close()
