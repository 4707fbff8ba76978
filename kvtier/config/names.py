"""The names the config, the storage manager, the CLI and the HTTP admin all use: one list each,
so a name added here is a choice everywhere (the modules that implement a name check at import
that they implement exactly these, and refuse to load otherwise)."""

from __future__ import annotations

import re

__all__ = ["TIERS", "CPU", "DISK", "REDIS", "LOWER_TIERS",
           "WRITE_THROUGH", "WRITE_THROUGH_SELECTIVE", "WRITE_BACK", "WRITE_POLICIES",
           "ADAPTIVE", "BEST_EFFORT", "WAIT_COMPLETE", "TIMEOUT", "PREFETCH_POLICIES",
           "NAMESPACE_PATTERN"]

CPU, DISK, REDIS = "cpu", "disk", "redis"
TIERS = (CPU, DISK, REDIS)  # fastest first: the order puts and gets walk
LOWER_TIERS = TIERS[1:]  # what attach/detach and the writers handle

# Write policies (`kvtier.storage.write_policy`).
WRITE_THROUGH = "write_through"
WRITE_THROUGH_SELECTIVE = "write_through_selective"
WRITE_BACK = "write_back"
WRITE_POLICIES = (WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK)

# Prefetch policies (`kvtier.storage.prefetch_policy`).
ADAPTIVE = "adaptive"
BEST_EFFORT = "best_effort"
WAIT_COMPLETE = "wait_complete"
TIMEOUT = "timeout"
PREFETCH_POLICIES = (ADAPTIVE, BEST_EFFORT, WAIT_COMPLETE, TIMEOUT)

# `key_namespace`: it appears in every key string, so tenants stay apart in ACL patterns.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
