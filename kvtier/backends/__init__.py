"""Storage tiers, looked up by name in the tier table (`kvtier.config.tiers`); a tier's
implementation is imported only when it is configured."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from kvtier.backends.base import BackendContext, HotTier, ProbeSample, StorageBackend
from kvtier.backends.inventory import InventorySummary, RecordInventory, StoredRecord
from kvtier.config.tiers import load_attr, tier_spec
from kvtier.errors import ConfigError

__all__ = ["BackendContext", "HotTier", "InventorySummary", "ProbeSample", "RecordInventory",
           "StorageBackend", "StoredRecord",
           "create_backend", "check_dependencies"]


def check_dependencies(name: str) -> None:
    """`ConfigError` naming the config key and the pip extra if tier `name` cannot be
    imported for lack of a package (checked without importing kvtier's tier module)."""
    spec = tier_spec(name)
    for module in spec.packages:
        try:
            missing = importlib.util.find_spec(module) is None
        except (ImportError, ValueError):  # e.g. blocked with sys.modules[module] = None
            missing = True
        if missing:
            raise ConfigError(f"{spec.key}: the {name} tier needs the {module!r} package, "
                              f"which is not installed: pip install 'kvtier[{spec.extra}]'")


def create_backend(name: str, ctx: BackendContext) -> StorageBackend:
    """Build the tier called `name`; `ConfigError` listing the valid names if unknown, or
    naming the pip extra when a package it needs is missing."""
    spec = tier_spec(name)
    check_dependencies(name)
    factory: Callable[[BackendContext], StorageBackend] = load_attr(spec.backend)
    return factory(ctx)
