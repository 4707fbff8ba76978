"""kvtier's configuration: one frozen dataclass, loaded strictly from YAML and the environment.

Key names follow LMCache where LMCache has the concept, so an LMCache YAML file loads unchanged.
Sources, later ones winning: defaults, the YAML file, `LMCACHE_<KEY>` (LMCache keys only), then
`KVTIER_<KEY>`. Every value is validated; a bad one raises `ConfigError` naming its source, the
key and, for unknown keys, the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import ConfigError

__all__ = ["Config", "load_config", "WRITE_POLICIES", "PREFETCH_POLICIES"]

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
REMOTE_SERDES = ("naive",)
CHUNK_MULTIPLE = 16

# Keys LMCache defines with the same meaning; only these may come from LMCACHE_<KEY>.
LMCACHE_KEYS = frozenset({
    "chunk_size", "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size",
    "remote_url", "remote_serde", "save_unfull_chunk", "blocking_timeout_secs",
})
# Environment variables that are not config keys: config file paths and the kernel override.
_NOT_ENV_KEYS = frozenset({"KVTIER_CONFIG_FILE", "LMCACHE_CONFIG_FILE", "KVTIER_KERNEL"})


@dataclass(frozen=True)
class Config:
    """The effective configuration. Sizes are in GB (10**9 bytes), as in LMCache."""

    chunk_size: int = 256
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0
    local_disk: str | None = None
    max_local_disk_size: float = 0.0
    remote_url: str | None = None
    remote_serde: str = "naive"
    save_unfull_chunk: bool = False
    blocking_timeout_secs: float = 10.0
    # kvtier's own keys
    hash_salt: str = ""
    write_policy: str = "write_through"
    selective_write_threshold: int = 2
    prefetch_policy: str = "best_effort"
    prefetch_timeout_base_ms: float = 5.0
    prefetch_timeout_per_token_ms: float = 0.01
    write_queue_chunks: int = 256
    remote_ttl_secs: int | None = None
    remote_timeout_secs: float = 2.0
    remote_segment_mb: float = 1.0  # measured: 1 MiB segments beat 4 MiB and unsegmented
    log_level: str | None = None

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def tiers(self) -> tuple[str, ...]:
        """Tier names from fastest to slowest; the order puts and gets walk."""
        order = (("cpu", self.local_cpu), ("disk", self.local_disk is not None),
                 ("redis", self.remote_url is not None))
        return tuple(name for name, enabled in order if enabled)

    @property
    def local_disk_path(self) -> Path | None:
        if self.local_disk is None:
            return None
        return Path(self.local_disk.removeprefix("file://"))

    def redacted(self) -> dict[str, Any]:
        """The config as a plain dict with credentials masked (for logs and `check-config`)."""
        out = dataclasses.asdict(self)
        if self.remote_url:
            out["remote_url"] = redact_url(self.remote_url)
        return out


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***`."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, hosts = rest.rpartition("@")
    user, colon, _ = creds.partition(":")
    masked = f"{user}:***" if colon else "***"
    return f"{scheme}://{masked}@{hosts}"


def _fail(source: str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {msg}")


def _validate(cfg: Config) -> None:
    src = "config"
    if cfg.chunk_size <= 0 or cfg.chunk_size % CHUNK_MULTIPLE:
        raise _fail(src, "chunk_size",
                    f"must be a positive multiple of {CHUNK_MULTIPLE}, got {cfg.chunk_size}")
    for key in ("max_local_cpu_size", "max_local_disk_size", "blocking_timeout_secs",
                "prefetch_timeout_base_ms", "prefetch_timeout_per_token_ms"):
        if getattr(cfg, key) < 0:
            raise _fail(src, key, f"must not be negative, got {getattr(cfg, key)}")
    if cfg.max_local_cpu_size * 1e9 < 4096:
        raise _fail(src, "max_local_cpu_size",
                    f"must be > 0 (it sizes the staging arena), got {cfg.max_local_cpu_size}")
    if cfg.local_disk is not None:
        if not cfg.local_disk.strip() or cfg.local_disk.startswith(("redis", "http")):
            raise _fail(src, "local_disk", f"must be a path or file:// URL, got {cfg.local_disk!r}")
        if cfg.max_local_disk_size <= 0:
            raise _fail(src, "max_local_disk_size",
                        f"must be > 0 when local_disk is set, got {cfg.max_local_disk_size}")
    choices = (("write_policy", WRITE_POLICIES), ("prefetch_policy", PREFETCH_POLICIES),
               ("remote_serde", REMOTE_SERDES))
    for key, allowed in choices:
        if getattr(cfg, key) not in allowed:
            raise _fail(src, key, f"must be one of {list(allowed)}, got {getattr(cfg, key)!r}")
    if cfg.selective_write_threshold < 1:
        raise _fail(src, "selective_write_threshold",
                    f"must be >= 1, got {cfg.selective_write_threshold}")
    if cfg.write_queue_chunks < 1:
        raise _fail(src, "write_queue_chunks", f"must be >= 1, got {cfg.write_queue_chunks}")
    if cfg.remote_ttl_secs is not None and cfg.remote_ttl_secs <= 0:
        raise _fail(src, "remote_ttl_secs", f"must be > 0, got {cfg.remote_ttl_secs}")
    if cfg.remote_timeout_secs <= 0:
        raise _fail(src, "remote_timeout_secs", f"must be > 0, got {cfg.remote_timeout_secs}")
    if not 0 < cfg.remote_segment_mb <= 512:
        raise _fail(src, "remote_segment_mb", f"must be in (0, 512], got {cfg.remote_segment_mb}")
    if not cfg.local_cpu and not cfg.local_disk and not cfg.remote_url:
        raise _fail(src, "local_cpu", "no tier enabled: set local_cpu, local_disk or remote_url")


_FIELDS = {f.name: f for f in fields(Config)}
_HINTS = typing.get_type_hints(Config)


def _base_type(key: str) -> tuple[type, bool]:
    hint = _HINTS[key]
    if isinstance(hint, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _coerce(source: str, key: str, value: Any, from_env: bool) -> Any:
    """`value` converted to the type of `key`, or ConfigError. Env values arrive as strings."""
    typ, optional = _base_type(key)
    if value is None or (from_env and optional and value.strip().lower() in ("", "none", "null")):
        if optional:
            return None
        raise _fail(source, key, f"must be a {typ.__name__}, got null")
    if from_env:
        try:
            value = yaml.safe_load(value) if typ is not str else value
        except yaml.YAMLError:
            raise _fail(source, key, f"cannot parse {value!r}") from None
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
        if from_env is False and isinstance(value, (int, float)) and key == "hash_salt":
            return str(value)
    raise _fail(source, key, f"must be a {typ.__name__}, got {type(value).__name__} {value!r}")


def _unknown(source: str, key: str) -> ConfigError:
    near = difflib.get_close_matches(key, _FIELDS, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys: {sorted(_FIELDS)}"
    return _fail(source, key, f"unknown key{hint}")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in _FIELDS:
            raise _unknown(str(path), str(key))
        out[key] = _coerce(str(path), key, value, from_env=False)
    return out


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ignored = []
    for prefix in ("LMCACHE_", "KVTIER_"):  # KVTIER_ wins: applied last
        for name, raw in sorted(env.items()):
            if not name.startswith(prefix) or name in _NOT_ENV_KEYS:
                continue
            key = name[len(prefix):].lower()
            if prefix == "LMCACHE_" and key not in LMCACHE_KEYS:
                ignored.append(name)
                continue
            if key not in _FIELDS:
                raise _unknown(f"environment {name}", key)
            out[key] = _coerce(f"environment {name}", key, raw, from_env=True)
    if ignored:
        logger.info("ignoring LMCache settings kvtier does not use: %s", ", ".join(ignored))
    return out


def load_config(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> Config:
    """Load the effective config.

    Args:
        path: a YAML file; when None, `KVTIER_CONFIG_FILE`, else `LMCACHE_CONFIG_FILE`, else
            defaults only.
        env: the environment to read (default `os.environ`).

    Raises:
        ConfigError: naming the file or variable and the key.
    """
    env = os.environ if env is None else env
    if path is None:
        path = env.get("KVTIER_CONFIG_FILE") or env.get("LMCACHE_CONFIG_FILE") or None
    values: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        values.update(_read_yaml(Path(path)))
        source = str(path)
    values.update(_read_env(env))
    try:
        cfg = Config(**values)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("config:", f"{source}:", 1)) from None
    logger.info("kvtier config (%s): %s", source, cfg.redacted())
    return cfg
