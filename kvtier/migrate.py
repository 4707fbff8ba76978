"""What each key of an LMCache config file becomes in kvtier (`kvtier migrate-config FILE`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvtier import lmcache_compat as compat
from kvtier.config import (
    Config,
    LoadedConfig,
    is_config_key,
    load_config_report,
    nearest_key,
    read_config_file,
    shown_value,
)
from kvtier.errors import ConfigError

__all__ = ["KeyMapping", "Migration", "explain"]


@dataclass(frozen=True)
class KeyMapping:
    """One key of the file: `kind` is "kvtier" (same key and meaning), "translated" (kvtier
    rewrites the value), "ignored" (LMCache key kvtier does not implement) or "unknown"."""

    key: str
    value: Any  # as shown to users: secrets masked
    kind: str
    note: str


@dataclass(frozen=True)
class Migration:
    """Every key of one file, and the load result: the config, or why it does not load."""

    rows: tuple[KeyMapping, ...]
    loaded: LoadedConfig | None
    error: str | None


def explain(path: str | os.PathLike[str]) -> Migration:
    """Map each key of the file at `path`, then load it (without the environment).

    Raises:
        ConfigError: the file cannot be read or is not a YAML mapping (no key to explain).
    """
    data = read_config_file(path)
    loaded: LoadedConfig | None = None
    error: str | None = None
    try:
        loaded = load_config_report(path, env={})
    except ConfigError as exc:
        error = str(exc)
    notes = dict(loaded.notes) if loaded else {}
    rows = []
    for key, value in data.items():
        rows.append(_row(key, value, notes))
        if key == "extra_config" and isinstance(value, dict):
            rows += [_extra_row(name, sub) for name, sub in value.items()]
    return Migration(tuple(rows), loaded, error)


def _row(key: str, value: Any, notes: dict[str, str]) -> KeyMapping:
    shown = shown_value(key, value)
    if is_config_key(key):
        if key in notes:
            return KeyMapping(key, shown, "translated", notes[key])
        return KeyMapping(key, shown, "kvtier", "same key and meaning in kvtier")
    instead = compat.instead_of(key)
    if instead is not None:
        return KeyMapping(key, shown, "ignored", instead)
    near = nearest_key(key)
    hint = f"; did you mean {near!r}?" if near else ""
    return KeyMapping(key, shown, "unknown", f"unknown key: an error in kvtier{hint}")


def _extra_row(name: str, value: Any) -> KeyMapping:
    key = f"extra_config.{name}"
    shown = shown_value(key, value)  # the dotted key: extra_config.hash_salt is a secret too
    if name in ("username", "password"):
        return KeyMapping(key, shown, "translated", "credentials of remote_url")
    return KeyMapping(key, shown, "ignored", "not used by kvtier")


def kvtier_yaml(config: Config, rows: tuple[KeyMapping, ...]) -> dict[str, Any]:
    """The kvtier keys of a migrated file: effective values of the keys the file set, as
    `Config.redacted` shows them (secrets `***`: copy those from the file)."""
    shown = config.redacted()
    return {r.key: shown[r.key] for r in rows if is_config_key(r.key)}
