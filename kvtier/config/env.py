"""Which environment variables set config keys, the warnings about the ones that do not, and
`~` in path keys (expanded from the environment's home directory).

Variables are read in two layers, later winning: `LMCACHE_<KEY>` (LMCache's keys only, see
`LMCACHE_KEYS`), then `KVTIER_<KEY>`. Two rules keep a stale environment from quietly changing
an explicit file:

- when the file is explicit (a path argument, `--kvtier-config-file`, `KVTIER_CONFIG_FILE`),
  `LMCACHE_<KEY>` variables are not applied; one warning names them. A file found through
  `LMCACHE_CONFIG_FILE` is an LMCache setup, where they keep applying;
- a `KVTIER_<KEY>` that overrides a value the file sets logs one warning per key, naming the
  variable and the file's value (secrets masked).

A `KVTIER_*` variable that is neither a config key nor one of kvtier's other settings
(`NOT_CONFIG_VARS`) is ignored with a warning and the nearest key: it may belong to a script or
a test harness, and stopping the launch over it would be worse than saying so.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvtier.config.lmcache import compat
from kvtier.config.redaction import shown_value

__all__ = ["LMCACHE_KEYS", "NOT_CONFIG_VARS", "EnvSettings", "read_env",
           "override_warnings", "explicit_file"]

# The config module's logger: these are messages about loading the config.
logger = logging.getLogger("kvtier.config")

# Keys LMCache defines with the same meaning; only these may come from LMCACHE_<KEY>, and these
# accept LMCache's value forms (numbers and booleans as strings).
LMCACHE_KEYS = frozenset({
    "chunk_size", "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size",
    "remote_url", "remote_serde", "save_unfull_chunk", "blocking_timeout_secs",
    "enable_blending", "blend_special_str", "blend_recompute_ratios", "blend_check_layers",
    "blend_min_tokens",
})
# Variables that are kvtier (or LMCache) settings but not config keys: config file paths, the
# kernel choice and build, the demo's SGLang shims, the background threads' nice increment, and
# what a launcher tells its workers (where they report their stop, the CPU attention hook).
NOT_CONFIG_VARS = frozenset({"KVTIER_CONFIG_FILE", "LMCACHE_CONFIG_FILE", "KVTIER_KERNEL",
                             "KVTIER_CACHE_DIR", "KVTIER_BUILD_EXT", "KVTIER_BUILD_VERBOSE",
                             "KVTIER_SGLANG_CPU_SHIMS", "KVTIER_BACKGROUND_NICE",
                             "KVTIER_CPU_PREFIX_ATTENTION_HOOK", "KVTIER_STOP_DIR"})


@dataclass
class EnvSettings:
    """What the environment sets. `values`: key -> value ready for the loader's coercion
    (strings, or LMCache's `remote_serde` already translated); `names`: key -> the variable it
    came from (the `KVTIER_` one where both are set)."""

    values: dict[str, Any] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)


def explicit_file(path: object, env: Mapping[str, str]) -> bool:
    """True when the config file was named for kvtier (a path argument or
    `KVTIER_CONFIG_FILE`), not found through `LMCACHE_CONFIG_FILE` or absent."""
    return path is not None or bool(env.get("KVTIER_CONFIG_FILE"))


def read_env(env: Mapping[str, str], keys: Collection[str], *, explicit: bool) -> EnvSettings:
    """The config values `env` sets, logging one line per kind of variable left out: LMCache
    variables kvtier does not use (info), `LMCACHE_<KEY>` left out for an `explicit` file
    (warning), unknown `KVTIER_*` names (a warning each, with the nearest key).

    Never raises: values are checked by the loader, which names the variable."""
    out = EnvSettings()
    unused: list[str] = []
    stale: list[str] = []
    for prefix in ("LMCACHE_", "KVTIER_"):  # KVTIER_ wins: applied last
        for name, raw in sorted(env.items()):
            if not name.startswith(prefix) or name in NOT_CONFIG_VARS:
                continue
            key = name[len(prefix):].lower()
            if prefix == "LMCACHE_":
                if key not in LMCACHE_KEYS:
                    unused.append(name)
                    continue
                if explicit:
                    stale.append(name)
                    continue
            if key not in keys:
                _warn_unknown(name, key, keys)
                continue
            value: Any = raw
            if prefix == "LMCACHE_" and key == "remote_serde":  # LMCache's null/cachegen
                try:
                    value = compat.translate_values({key: yaml.safe_load(raw)}, None, name) \
                        .values[key]
                except yaml.YAMLError:
                    pass  # the loader's coercion reports it, naming the variable
            out.values[key] = value
            out.names[key] = name
    if unused:
        logger.info("ignoring LMCache settings kvtier does not use: %s", ", ".join(unused))
    if stale:
        logger.warning("ignoring %s: the config file was given explicitly (KVTIER_CONFIG_FILE, "
                       "--kvtier-config-file or a path), so LMCACHE_* variables do not "
                       "override it; set the key in the file or as KVTIER_<KEY>",
                       ", ".join(stale))
    return out


def _warn_unknown(name: str, key: str, keys: Collection[str]) -> None:
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    hint = f"; did you mean {name.split('_', 1)[0]}_{near[0].upper()} ({near[0]})?" if near \
        else ""
    logger.warning("ignoring environment variable %s: not a kvtier config key or setting%s",
                   name, hint)


def override_warnings(file_values: Mapping[str, Any], env_values: Mapping[str, Any],
                      names: Mapping[str, str], source: str) -> list[str]:
    """One line per `KVTIER_<KEY>` whose value replaces a different value the file sets, both
    values as they may be shown (`shown_value`: secrets masked)."""
    lines = []
    for key, value in env_values.items():
        if key in file_values and file_values[key] != value and names[key].startswith("KVTIER_"):
            lines.append(f"{names[key]}={shown_value(key, value)!r} overrides {key}: "
                         f"{shown_value(key, file_values[key])!r} from {source}")
    return lines
