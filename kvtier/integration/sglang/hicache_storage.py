"""Deprecated path of `kvtier.integration.sglang.hicache.storage`, kept for HiCache configs
that name it (`"module_path": "kvtier.integration.sglang.hicache_storage"`)."""

from __future__ import annotations

from kvtier.integration.sglang.hicache.storage import KVTierHiCacheStorage

__all__ = ["KVTierHiCacheStorage"]
