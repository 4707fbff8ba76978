"""Storage tiers, looked up by name; implementations are imported only when configured."""

from __future__ import annotations

import importlib
import importlib.util

from kvtier.backends.base import BackendContext, HotTier, ProbeSample, StorageBackend
from kvtier.config.names import CPU, DISK, REDIS
from kvtier.errors import ConfigError

__all__ = ["BackendContext", "HotTier", "ProbeSample", "StorageBackend", "create_backend",
           "check_dependencies", "BACKENDS"]

# name -> "module:Class"; importing redis-py happens only when the redis tier is configured.
BACKENDS: dict[str, str] = {
    CPU: "kvtier.backends.cpu:CPUBackend",
    DISK: "kvtier.backends.disk:DiskBackend",
    REDIS: "kvtier.backends.redis:RedisBackend",
}


# name -> (the config key that turns it on, third-party modules it needs, the extra that
# installs them)
REQUIREMENTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    REDIS: ("remote_url", ("redis",), "redis"),
}


def check_dependencies(name: str) -> None:
    """`ConfigError` naming the config key and the pip extra if tier `name` cannot be
    imported for lack of a package (checked without importing kvtier's tier module)."""
    key, modules, extra = REQUIREMENTS.get(name, ("", (), ""))
    for module in modules:
        try:
            missing = importlib.util.find_spec(module) is None
        except (ImportError, ValueError):  # e.g. blocked with sys.modules[module] = None
            missing = True
        if missing:
            raise ConfigError(f"{key}: the {name} tier needs the {module!r} package, which is "
                              f"not installed: pip install 'kvtier[{extra}]'")


def create_backend(name: str, ctx: BackendContext) -> StorageBackend:
    """Build the tier called `name`; `ConfigError` listing the valid names if unknown, or
    naming the pip extra when a package it needs is missing."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown storage tier {name!r}; valid: {sorted(BACKENDS)}") from None
    check_dependencies(name)
    module_name, _, cls_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(ctx)
