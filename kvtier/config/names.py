"""The names the config, the storage manager, the CLI and the HTTP admin all use: one list each
for the policies, so a name added here is a choice everywhere (the modules that implement a
name check at import that they implement exactly these, and refuse to load otherwise). The
tiers are listed in `kvtier.config.tiers`; the built-in ones' names are here."""

from __future__ import annotations

import re

__all__ = ["CPU", "DISK", "REDIS",
           "WRITE_THROUGH", "WRITE_THROUGH_SELECTIVE", "WRITE_BACK", "WRITE_POLICIES",
           "ADAPTIVE", "BEST_EFFORT", "WAIT_COMPLETE", "TIMEOUT", "PREFETCH_POLICIES",
           "LRU", "ARC", "LFUDA", "EVICTION_POLICIES", "ALWAYS", "SECOND_HIT",
           "ADMISSION_POLICIES", "NAMESPACE_PATTERN"]

# The built-in tiers' names (the tiers themselves, in order: `kvtier.config.tiers`).
CPU, DISK, REDIS = "cpu", "disk", "redis"

# Write policies (`kvtier.storage.write_policy`).
WRITE_THROUGH = "write_through"
WRITE_THROUGH_SELECTIVE = "write_through_selective"
WRITE_BACK = "write_back"
WRITE_POLICIES = (WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK)

# Prefetch policies (`kvtier.storage.prefetch.policy`).
ADAPTIVE = "adaptive"
BEST_EFFORT = "best_effort"
WAIT_COMPLETE = "wait_complete"
TIMEOUT = "timeout"
PREFETCH_POLICIES = (ADAPTIVE, BEST_EFFORT, WAIT_COMPLETE, TIMEOUT)

# Eviction policies of the CPU tier (`kvtier.backends.cpu`): `lru` (leaves, least recently used
# first), `arc` (first-seen prefixes in a window, the others in a main segment, the split
# adapted to which comes back: `kvtier.backends.segments`), `lfuda` (leaves by uses plus the
# tier's age: `kvtier.backends.cpu_lfuda`).
LRU = "lru"
ARC = "arc"
LFUDA = "lfuda"
EVICTION_POLICIES = (LRU, ARC, LFUDA)

# Admission policies (`kvtier.storage.admission`): `always` stores every chunk offered;
# `second_hit` refuses, when storing would evict, a prefix whose first new chunk was never seen;
# `adaptive` (ADAPTIVE's string) is `second_hit` only while the tier evicts what comes back.
ALWAYS = "always"
SECOND_HIT = "second_hit"
ADMISSION_POLICIES = (ALWAYS, SECOND_HIT, ADAPTIVE)

# `key_namespace`: it appears in every key string, so tenants stay apart in ACL patterns.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
