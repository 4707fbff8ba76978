"""kvtier: keep the KV cache of LLM serving engines in CPU memory, on disk and in Redis."""

from __future__ import annotations

from kvtier.config import Config, load_config
from kvtier.errors import BackendUnavailable, ConfigError, CorruptEntry, KVTierError

__all__ = [
    "BackendUnavailable",
    "CacheEngine",
    "Config",
    "ConfigError",
    "CorruptEntry",
    "KVLayout",
    "KVTierError",
    "MemoryFormat",
    "MemoryObj",
    "load_config",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # These pull in torch (seconds): `import kvtier`, and every `kvtier` command that needs no
    # tensor (`--help`, check-config, ls), stay light until one of them is asked for.
    if name == "CacheEngine":
        from kvtier.engine import CacheEngine

        return CacheEngine
    if name in ("KVLayout", "MemoryFormat", "MemoryObj"):
        from kvtier import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
