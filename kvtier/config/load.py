"""Loading the config: strictly from YAML and the environment into one frozen `Config`.

Key names follow LMCache where LMCache has the concept, so an LMCache YAML file loads unchanged.
Sources, later ones winning: defaults, the YAML file, `LMCACHE_<KEY>` (LMCache keys only; not
over an explicit file), then `KVTIER_<KEY>` (`kvtier.config.env`). A file's keys fall in three
groups: kvtier's own (every field of `Config`, checked strictly), LMCache keys kvtier does not
implement (`kvtier.config.lmcache.compat`: accepted, listed in one warning with what kvtier does
instead), and unknown keys (`ConfigError` with the nearest valid key). Every value is
validated; a bad one raises `ConfigError` naming its source and key.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from kvtier.config.env import LMCACHE_KEYS, explicit_file, override_warnings, read_env
from kvtier.config.file import read_yaml_mapping
from kvtier.config.host import physical_memory_bytes
from kvtier.config.lmcache import compat
from kvtier.config.redaction import brief, shown_in_error, shown_value
from kvtier.config.schema import TRANSFER_ARENA_GB, Config
from kvtier.errors import ConfigError

__all__ = ["LoadedConfig", "load_config", "load_config_report", "read_config_file",
           "is_config_key", "nearest_key", "with_overrides"]

logger = logging.getLogger(__name__)


def _fail(source: str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {msg}")


_FIELDS = {f.name: f for f in fields(Config)}
_HINTS = typing.get_type_hints(Config)


def _base_type(key: str) -> tuple[type, bool]:
    hint = _HINTS[key]
    if isinstance(hint, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _lmcache_string(key: str, typ: type, value: str) -> Any:
    """LMCache's forms of numbers and booleans as strings ('5', '5.0', 'False'), or the
    string unchanged when it is not one."""
    text = value.strip()
    try:
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
    except ValueError:
        return value
    if typ is bool and text.lower() in ("true", "1", "false", "0"):
        return text.lower() in ("true", "1")
    return value


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
            raise _fail(source, key, f"cannot parse {brief(value)}") from None
    if typing.get_origin(typ) is tuple:
        return _coerce_list(source, key, typing.get_args(typ)[0], value)
    if key in LMCACHE_KEYS and isinstance(value, str) and typ is not str:
        value = _lmcache_string(key, typ, value)
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e300 else math.inf  # no OverflowError
            if not math.isfinite(number):
                raise _fail(source, key, f"must be a finite number, got {number}")
            return number
    elif typ is str:
        if isinstance(value, str):
            # A URL copied with a trailing space or newline is the URL (and a password
            # followed by a space must not end up in a message).
            return value.strip() if key == "remote_url" else value
        if key == "hash_salt" and isinstance(value, (bool, int, float)):
            # str() would turn yes/on/true into 'True', 1e30 into 1e+30
            raise _fail(source, key, f"must be a string: quote it (hash_salt: '...'); YAML "
                        f"read a {type(value).__name__} here, which would lose what was "
                        "written")
    raise _fail(source, key, f"must be a {typ.__name__}, got {type(value).__name__} "
                f"{shown_in_error(key, value)}")


def _coerce_list(source: str, key: str, item: type, value: Any) -> tuple[Any, ...]:
    """A YAML list (or one value, as a list of one) of `item`s, as a tuple."""
    values = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for v in values:
        if isinstance(v, str):
            v = _lmcache_string(key, item, v)
        ok = isinstance(v, (int, float)) if item is float else isinstance(v, item)
        if isinstance(v, bool) or not ok:
            raise _fail(source, key, f"must be a list of {item.__name__}s, got "
                        f"{shown_in_error(key, value)}")
        out.append(item(v))
    return tuple(out)


def is_config_key(key: str) -> bool:
    """True if `key` is a kvtier config key (a field of `Config`)."""
    return key in _FIELDS


def nearest_key(key: str) -> str | None:
    """The kvtier config key closest to `key` in spelling, if any is close."""
    near = difflib.get_close_matches(key, _FIELDS, n=1, cutoff=0.5)
    return near[0] if near else None


def _unknown(source: str, key: str) -> ConfigError:
    # no LMCache version had `key`: the nearest kvtier or LMCache key, or what to use instead
    return _fail(source, key, f"unknown key; {compat.unknown_hint(key, nearest_key(key))}")


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's top-level mapping, keys and values as YAML gives them (strict: UTF-8, no
    duplicate keys, string keys; `ConfigError` naming the file otherwise). A leading `~` is
    the home directory."""
    path = Path(path).expanduser()
    data = read_yaml_mapping(path)
    for key in data:
        if not isinstance(key, str):
            raise _unknown(str(path), str(key))
    return data


@dataclass(frozen=True)
class LoadedConfig:
    """A loaded config and how each key of its sources was used.

    `given`: kvtier keys set by the file or the environment, with their values as shown to
    users (credentials masked). `ignored`: LMCache keys kvtier does not implement, with what it
    does instead. `notes`: LMCache values kvtier translated, as (key, what kvtier does).
    `origins`: every key and where its value came from: "default", "file" or the variable.
    """

    config: Config
    source: str
    given: tuple[tuple[str, Any], ...]
    ignored: tuple[tuple[str, str], ...]
    notes: tuple[tuple[str, str], ...]
    origins: tuple[tuple[str, str], ...] = ()

    def warning(self) -> str | None:
        """The one warning a load logs, or None when nothing was ignored or translated."""
        lines = [f"  {key}: {instead}" for key, instead in self.ignored]
        lines += [f"  {key}: {note}" for key, note in self.notes]
        if not lines:
            return None
        return (f"kvtier config {self.source}: LMCache keys and values kvtier does not "
                "implement (what it does instead):\n" + "\n".join(lines))


def _split_file(data: Mapping[str, Any], source: str) -> tuple[dict[str, Any],
                                                                list[tuple[str, str]],
                                                                Mapping[str, Any]]:
    """(kvtier keys, ignored LMCache keys with what kvtier does instead, extra_config)."""
    mine: dict[str, Any] = {}
    ignored: list[tuple[str, str]] = []
    extra: Mapping[str, Any] = {}
    for key, value in data.items():
        if key in _FIELDS:
            mine[key] = value
            continue
        instead = compat.instead_of(key)
        if instead is None:
            raise _unknown(source, key)
        ignored.append((key, instead))
        if key == "extra_config" and value is not None:
            if not isinstance(value, Mapping):
                raise _fail(source, key, f"must be a mapping, got {type(value).__name__}")
            extra = value
            ignored += [(name, "not used by kvtier")
                        for name in compat.extra_config_ignored(value)]
    return mine, ignored, extra


def _transfer_arena(values: dict[str, Any]) -> tuple[str, str] | None:
    """`local_cpu: false`: no CPU tier, and kvtier still needs an arena to move chunks
    through. Unsized (or LMCache's `max_local_cpu_size: 0`), it gets a small one, not the
    CPU tier's default (5 GB held for a cache that is not there); sized larger than that, it
    is kept and the note says what the memory is for."""
    if values.get("local_cpu") is not False:
        return None
    given = values.get("max_local_cpu_size")
    size = min(TRANSFER_ARENA_GB, physical_memory_bytes() / 4e9)
    if given in (None, 0):
        values["max_local_cpu_size"] = size
        return ("max_local_cpu_size", f"{'unset' if given is None else '0'} with local_cpu: "
                f"false: no CPU tier, but kvtier still moves chunks to and from disk/Redis "
                f"through a {size:g} GB transfer arena (set max_local_cpu_size to size it)")
    if isinstance(given, (int, float)) and given > TRANSFER_ARENA_GB:
        return ("max_local_cpu_size", f"{given:g} GB with local_cpu: false: no CPU cache, yet "
                f"the process holds all {given:g} GB as its transfer arena (loads and stores "
                f"pass through it); {TRANSFER_ARENA_GB:g} GB is enough unless single prompts "
                "are larger")
    return None


def with_overrides(cfg: Config, values: Mapping[str, Any], source: str) -> Config:
    """`cfg` with kvtier `values` replaced, checked as strictly as a file (`source` names
    where they came from in errors)."""
    for key in values:
        if not is_config_key(key):
            raise _unknown(source, key)
    coerced = {k: _coerce(source, k, v, from_env=False) for k, v in values.items()}
    try:
        return dataclasses.replace(cfg, **coerced)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("config:", f"{source}:", 1)) from None


def load_config_report(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> LoadedConfig:
    """Load the effective config and report how each key was used (see `load_config`)."""
    env = os.environ if env is None else env
    explicit = explicit_file(path, env)  # before the path is looked up in the environment
    if path is None:
        path = env.get("KVTIER_CONFIG_FILE") or env.get("LMCACHE_CONFIG_FILE") or None
    source = "defaults"
    raw: dict[str, Any] = {}
    mine: dict[str, Any] = {}
    ignored: list[tuple[str, str]] = []
    notes: list[tuple[str, str]] = []
    file_data: dict[str, Any] = {}
    if path is not None:
        source = str(path)
        file_data = read_config_file(path)
        mine, ignored, extra = _split_file(file_data, source)
        translated = compat.translate_values(mine, extra, source)
        notes += translated.notes
        raw = {k: _coerce(source, k, v, from_env=False) for k, v in translated.values.items()}
    settings = read_env(env, _FIELDS, explicit=explicit)
    env_names = settings.names
    from_env = {k: _coerce(f"environment {env_names[k]}", k, v, from_env=True)
                for k, v in settings.values.items()}
    for line in override_warnings(raw, from_env, env_names, source):
        logger.warning("kvtier config: %s", line)
    values = {**raw, **from_env}
    given = {**mine, **from_env}
    arena_note = _transfer_arena(values)
    if arena_note:
        notes.append(arena_note)
    try:
        cfg = Config(**values)
    except ConfigError as exc:
        # "config: key: ..." -> the file or variable the key's value came from
        key = str(exc).split(": ", 2)[1] if str(exc).count(": ") >= 2 else ""
        origin = f"environment {env_names[key]}" if key in env_names else source
        msg = str(exc).replace("config:", f"{origin}:", 1)
        refused = compat.unsupported_storage(file_data) if key == "local_cpu" else None
        if refused is not None:  # name the LMCache key the file kept its KV in
            msg += f" [this file keeps its KV in {refused[0]}: {refused[1]}]"
        raise ConfigError(msg) from None
    origins = {k: env_names.get(k, "file" if k in raw else "default") for k in _FIELDS}
    return LoadedConfig(cfg, source, tuple((k, shown_value(k, v)) for k, v in given.items()),
                        tuple(ignored), tuple(notes), tuple(origins.items()))


def load_config(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> Config:
    """Load the effective config; log one warning listing LMCache keys and values kvtier does
    not implement, with what it does instead.

    Args:
        path: a YAML file; when None, `KVTIER_CONFIG_FILE`, else `LMCACHE_CONFIG_FILE`, else
            defaults only.
        env: the environment to read (default `os.environ`); see `kvtier.config.env` for
            which variables apply (no `LMCACHE_<KEY>` over an explicit file) and what warns.

    Raises:
        ConfigError: naming the file or variable and the key.
    """
    loaded = load_config_report(path, env=env)
    warning = loaded.warning()
    if warning:
        logger.warning("%s", warning)
    logger.info("kvtier config (%s): %s", loaded.source, loaded.config.redacted())
    return loaded.config
