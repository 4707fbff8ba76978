"""The names the config, the storage manager, the CLI and the HTTP admin all use: one list each,
so a name added here is a choice everywhere (the modules that implement a name check at import
that they implement exactly these)."""

from __future__ import annotations

__all__ = ["TIERS", "CPU", "DISK", "REDIS", "LOWER_TIERS", "WRITE_POLICIES", "PREFETCH_POLICIES"]

CPU, DISK, REDIS = "cpu", "disk", "redis"
TIERS = (CPU, DISK, REDIS)  # fastest first: the order puts and gets walk
LOWER_TIERS = TIERS[1:]  # what attach/detach and the writers handle
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("adaptive", "best_effort", "wait_complete", "timeout")
