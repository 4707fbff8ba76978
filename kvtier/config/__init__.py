"""kvtier's configuration, the foundation every other part stands on (it imports none of them).

- `schema`: the `Config` tree and the checks of its values;
- `load`: strict loading from YAML and the environment (`env`, `file`);
- `host`: whether a config fits the machine (memory, cgroup, disk);
- `names`, `urls`, `paths`, `redaction`: the shared names, remote URLs, `local_disk` as LMCache
  reads it, what a message may show;
- `lmcache/`: LMCache's keys, what kvtier does with each, and `kvtier migrate-config`.
"""

from __future__ import annotations

from kvtier.config.host import physical_memory_bytes
from kvtier.config.load import (
    LoadedConfig,
    is_config_key,
    load_config,
    load_config_report,
    nearest_key,
    read_config_file,
    with_overrides,
)
from kvtier.config.redaction import shown_value
from kvtier.config.schema import Config
from kvtier.config.urls import redact_url
from kvtier.errors import ConfigError

__all__ = ["Config", "ConfigError", "LoadedConfig", "load_config", "load_config_report",
           "read_config_file", "is_config_key", "nearest_key", "with_overrides", "redact_url",
           "shown_value", "physical_memory_bytes"]
