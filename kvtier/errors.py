"""The kvtier exception tree.

Only programming errors (bad arguments, bad config) reach callers of `CacheEngine`; tier
failures are turned into misses by the storage manager.
"""

from __future__ import annotations

__all__ = ["KVTierError", "ConfigError", "BackendUnavailable", "CorruptEntry"]


class KVTierError(Exception):
    """Base of every exception kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A config file, key, value or environment override is invalid."""


class BackendUnavailable(KVTierError):
    """A tier cannot be reached (server down, directory gone); callers treat it as a miss."""


class CorruptEntry(KVTierError):
    """A stored record failed validation; it must be deleted and treated as a miss."""
