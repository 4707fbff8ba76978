"""The live set of tiers and their writers, changed while stores and loads run.

Readers take the current lists (`tiers`, `writers`) without locking: a change publishes new
lists and never mutates old ones, so a call that started on the old set finishes on it. Every
call into a tier is counted while it runs (`using`), so a detached tier is closed only after the
calls that still use it are done.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.backends import StorageBackend
from kvtier.writer import TierWriter

__all__ = ["TierSet", "TIER_ORDER"]

TIER_ORDER = ("cpu", "disk", "redis")  # fastest first: the order puts and gets walk


class TierSet:
    def __init__(self, tiers: list[StorageBackend], writers: list[TierWriter]):
        self.tiers: list[StorageBackend] = list(tiers)
        self.writers: list[TierWriter] = list(writers)
        self._active: Counter[int] = Counter()  # id(tier) -> calls running on it
        self._cond = threading.Condition()

    @contextmanager
    def using(self, tier: StorageBackend) -> Iterator[None]:
        """Count a call into `tier` for as long as the block runs."""
        with self._cond:
            self._active[id(tier)] += 1
        try:
            yield
        finally:
            with self._cond:
                self._active[id(tier)] -= 1
                if not self._active[id(tier)]:
                    del self._active[id(tier)]
                    self._cond.notify_all()

    def find(self, name: str) -> StorageBackend | None:
        return next((t for t in self.tiers if t.name == name), None)

    def add(self, tier: StorageBackend, writer: TierWriter | None) -> None:
        """Publish `tier` (in `TIER_ORDER`) and its writer."""
        with self._cond:
            if self.find(tier.name) is not None:
                raise ValueError(f"tier {tier.name!r} is already attached")
            rank = {name: i for i, name in enumerate(TIER_ORDER)}
            self.tiers = sorted([*self.tiers, tier], key=lambda t: rank.get(t.name, 99))
            if writer is not None:
                self.writers = [*self.writers, writer]

    def remove(self, name: str) -> tuple[StorageBackend, TierWriter | None]:
        """Unpublish tier `name`; returns it and its writer. `ValueError` if not attached."""
        with self._cond:
            tier = self.find(name)
            if tier is None:
                raise ValueError(f"tier {name!r} is not attached; attached: "
                                 f"{[t.name for t in self.tiers]}")
            writer = next((w for w in self.writers if w.backend is tier), None)
            self.tiers = [t for t in self.tiers if t is not tier]
            self.writers = [w for w in self.writers if w is not writer]
            return tier, writer

    def wait_unused(self, tier: StorageBackend, timeout: float) -> bool:
        """Wait until no call runs on `tier`; False if `timeout` ran out first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._active[id(tier)]:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._active.pop(id(tier), None)
            return True
