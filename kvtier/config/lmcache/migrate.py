"""What each key of an LMCache config file becomes in kvtier (`kvtier migrate-config FILE`): the
classification of `kvtier.config.lmcache.keys`, row by row, then the load result."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvtier.config import (
    Config,
    LoadedConfig,
    is_config_key,
    load_config_report,
    nearest_key,
    read_config_file,
    shown_value,
)
from kvtier.config.lmcache import compat
from kvtier.errors import ConfigError

__all__ = ["KeyMapping", "Migration", "explain"]


@dataclass(frozen=True)
class KeyMapping:
    """One key of the file: `kind` is "kvtier" (same key and meaning), "translated" (kvtier
    rewrites the value), "ignored" (an LMCache key kvtier accepts; `note`: why, and what it does
    instead), "unsupported" (storage or transfer kvtier does not have; `note`: what to use
    instead) or "unknown" (no LMCache version had it: an error, with the nearest key). The note
    is the line the load warning or error shows."""

    key: str
    value: Any  # as shown to users: secrets masked
    kind: str
    note: str


@dataclass(frozen=True)
class Migration:
    """Every key of one file, and the load result: the config, or why it does not load (the
    load error, followed by the key the file keeps its KV in when that is storage kvtier does
    not have)."""

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
        refused = compat.unsupported_storage(data)
        if refused is not None and "keeps its KV in" not in error:  # the loader may name it
            error += f" [this file keeps its KV in {refused[0]}: {refused[1]}]"
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
        scheme = value.partition("://")[0] if key == "remote_url" and isinstance(value, str) \
            else None
        if scheme in compat.UNSUPPORTED_SCHEMES:
            return KeyMapping(key, shown, "unsupported",
                              f"not supported: {scheme}:// is "
                              f"{compat.UNSUPPORTED_SCHEMES[scheme]}")
        if key in notes:
            return KeyMapping(key, shown, "translated", notes[key])
        return KeyMapping(key, shown, "kvtier", "same key and meaning in kvtier")
    entry = compat.classify(key)
    if entry is not None and entry.status != "same":
        return KeyMapping(key, shown, entry.status, entry.note)
    if key in compat.IN_EXAMPLES:
        return KeyMapping(key, shown, "ignored", compat.IN_EXAMPLES[key])
    return KeyMapping(key, shown, "unknown",
                      f"unknown key (no LMCache version had it): an error in kvtier; "
                      f"{compat.unknown_hint(key, nearest_key(key))}")


def _extra_row(name: str, value: Any) -> KeyMapping:
    key = f"extra_config.{name}"
    shown = shown_value(key, value)  # the dotted key: extra_config.hash_salt is a secret too
    if name in ("username", "password"):
        return KeyMapping(key, shown, "translated", "credentials of remote_url")
    if name in compat.EXTRA_STORAGE:
        return KeyMapping(key, shown, "unsupported", compat.EXTRA_STORAGE[name])
    return KeyMapping(key, shown, "ignored", "not used by kvtier")


def kvtier_yaml(config: Config, rows: tuple[KeyMapping, ...]) -> dict[str, Any]:
    """The kvtier keys of a migrated file: effective values of the keys the file set, as
    `Config.redacted` shows them (secrets `***`: copy those from the file)."""
    shown = config.redacted()
    return {r.key: shown[r.key] for r in rows if is_config_key(r.key)}
