"""The storage tiers, one row each: the only place kvtier lists them.

A row says what the config, the storage manager, the CLI and the HTTP admin need to know about
a tier: which config key turns it on (and, for a URL, which schemes it serves), the backend
class that implements it, the third-party packages it needs and which keys a run-time attach
may change. Classes and parsers are named as "module:attribute" strings, imported only when
that tier is configured (redis-py loads only for a Redis URL); tests/config/test_tiers.py
resolves every one of them (the architecture test's import graph does not see them).

Adding a tier is one folder under `kvtier/backends/` and one row here (`register` adds one at
run time, for tests and plugins). A tier's own checks and read-only look go through its row
(`check`, the inventory's `peek`); tests/test_architecture.py lists the few modules that may
still name one tier (the CPU tier is the storage manager's hot tier by design).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from kvtier.config.names import CPU, DISK, REDIS
from kvtier.errors import ConfigError

__all__ = ["TierSpec", "TABLE", "register", "tier_spec", "tier_names", "lower_tier_names",
           "url_tier", "remote_schemes", "load_attr", "tier_problem", "REDIS_SCHEMES"]

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis-sentinel", "redis-cluster",
                 "resp")  # resp: LMCache's RESP client, read as redis://


@dataclass(frozen=True)
class TierSpec:
    """One storage tier.

    Attributes:
        name: the tier's name in logs, metrics, the CLI and the admin routes.
        backend: "module:Class" of its `StorageBackend`.
        key: the config key that turns it on (a bool, a path or a URL).
        schemes: for a tier turned on by a URL key, the URL schemes it serves.
        url_parser: "module:function" parsing such a URL in full (`ConfigError` naming the
            problem), or "" when the scheme check is all there is.
        packages: third-party modules it imports; `extra` is the pip extra installing them.
        overridable: config keys an HTTP attach may change (how the tier behaves, never
            where it is); a tier with none cannot be attached at run time.
        inventory: "module:Class" of its `RecordInventory` (`kvtier ls/stats/purge`), or ""
            for a tier that lives in a server's memory.
        medium: its storage medium in SGLang's KV events (`CPU_PINNED`, `DISK`, `EXTERNAL`),
            or "" for none (its changes are not published).
        check: "module:function" taking a config and returning why this host cannot give
            the tier what it asks (`str`), or None; run before the tier is opened (a launch's
            preflight, an HTTP attach), beyond the config's own validation. "" for none.
    """

    name: str
    backend: str
    key: str
    schemes: tuple[str, ...] = ()
    url_parser: str = ""
    packages: tuple[str, ...] = ()
    extra: str = ""
    overridable: frozenset[str] = frozenset()
    inventory: str = ""
    medium: str = ""
    check: str = ""

    def enabled(self, config: object) -> bool:
        """Whether `config` (a `Config`: the schema builds on this table) turns this tier on."""
        value = getattr(config, self.key)
        if self.schemes:
            return isinstance(value, str) and value.partition("://")[0] in self.schemes
        return value is not None and value is not False

    @property
    def lower(self) -> bool:
        """A tier below the CPU tier: written by a writer thread, attachable at run time."""
        return self.name != CPU


# Fastest first: the order puts and gets walk.
TABLE: list[TierSpec] = [
    TierSpec(CPU, "kvtier.backends.cpu_tier:CPUTier", "local_cpu", medium="CPU_PINNED"),
    TierSpec(DISK, "kvtier.backends.disk:DiskBackend", "local_disk",
             overridable=frozenset({"max_local_disk_size"}),
             inventory="kvtier.backends.disk.inventory:DiskInventory", medium="DISK",
             check="kvtier.backends.disk.checks:disk_tier_problem"),
    TierSpec(REDIS, "kvtier.backends.redis:RedisBackend", "remote_url", schemes=REDIS_SCHEMES,
             url_parser="kvtier.backends.redis.url:parse_remote_url", packages=("redis",),
             extra="redis", overridable=frozenset({"remote_timeout_secs", "remote_ttl_secs"}),
             inventory="kvtier.backends.redis.inventory:RedisInventory", medium="EXTERNAL"),
]


def register(spec: TierSpec, *, before: str | None = None) -> None:
    """Add tier `spec` to the table (before tier `before`, else last: the slowest).
    `ValueError` if a tier of that name, or one serving one of its schemes, exists."""
    clash = [s.name for s in TABLE if s.name == spec.name or set(s.schemes) & set(spec.schemes)]
    if clash:
        raise ValueError(f"tier {spec.name!r} clashes with {clash} (same name or scheme)")
    at = next((i for i, s in enumerate(TABLE) if s.name == before), len(TABLE))
    TABLE.insert(at, spec)


def tier_spec(name: str) -> TierSpec:
    """The row of tier `name`; `ConfigError` listing the valid names if there is none."""
    for spec in TABLE:
        if spec.name == name:
            return spec
    raise ConfigError(f"unknown storage tier {name!r}; valid: {tier_names()}")


def tier_names() -> list[str]:
    return [spec.name for spec in TABLE]


def lower_tier_names() -> list[str]:
    """The tiers below the CPU tier, fastest first."""
    return [spec.name for spec in TABLE if spec.lower]


def remote_schemes() -> list[str]:
    """Every URL scheme some tier serves, in table order."""
    return [scheme for spec in TABLE for scheme in spec.schemes]


def url_tier(url: str) -> TierSpec | None:
    """The tier serving `url`'s scheme, or None."""
    scheme = url.partition("://")[0]
    return next((spec for spec in TABLE if scheme in spec.schemes), None)


def tier_problem(name: str, config: object) -> str | None:
    """Why this host cannot give tier `name` what `config` asks (its row's `check`), or None."""
    spec = tier_spec(name)
    return load_attr(spec.check)(config) if spec.check else None


def load_attr(target: str) -> Any:
    """The attribute a "module:attribute" string of the table names (importing its module)."""
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
