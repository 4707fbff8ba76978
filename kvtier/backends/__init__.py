"""Storage tiers, looked up by name; implementations are imported only when configured."""

from __future__ import annotations

import importlib

from kvtier.backends.base import BackendContext, StorageBackend
from kvtier.errors import ConfigError

__all__ = ["BackendContext", "StorageBackend", "create_backend", "BACKENDS"]

# name -> "module:Class"; importing redis-py happens only when the redis tier is configured.
BACKENDS: dict[str, str] = {
    "cpu": "kvtier.backends.cpu:CPUBackend",
    "disk": "kvtier.backends.disk:DiskBackend",
    "redis": "kvtier.backends.redis:RedisBackend",
}


def create_backend(name: str, ctx: BackendContext) -> StorageBackend:
    """Build the tier called `name`; `ConfigError` listing the valid names if unknown."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown storage tier {name!r}; valid: {sorted(BACKENDS)}") from None
    module_name, _, cls_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(ctx)
