"""kvtier: keep the KV cache of LLM serving engines in CPU memory, on disk and in Redis."""

from __future__ import annotations

from kvtier.config import Config, load_config
from kvtier.errors import BackendUnavailable, ConfigError, CorruptEntry, KVTierError
from kvtier.memory import KVLayout, MemoryFormat, MemoryObj

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
    # CacheEngine pulls in the storage stack; keep `import kvtier` (and the config CLI) light.
    if name == "CacheEngine":
        from kvtier.engine import CacheEngine

        return CacheEngine
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
