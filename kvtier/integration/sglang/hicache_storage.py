"""kvtier as an L3 for SGLang's hierarchical cache (HiCache): `--hicache-storage-backend dynamic`.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integration.sglang.hicache_storage",
        "class_name": "KVTierHiCacheStorage", "interface_v1": 1,
        "kvtier_config_file": "/etc/kvtier.yaml"}'

HiCache moves pages between its host pool and the L3 by page hash (SGLang's chained SHA-256 of
the prefix), never by token ids, so each page is stored as one kvtier chunk under
`kvtier/v2/{namespace}/{model}@hicache-{host layout}/{layout fingerprint}/{rank}of{world}/{page
hash}` (with `hash_salt`, a salted digest of the page hash). The
record's token field, which kvtier verifies on every read, then carries bytes derived from the
page hash. Reads and writes go through kvtier's StorageManager, so the tiers (CPU, disk, Redis),
write policy and failure handling are kvtier's: a tier that fails is a miss, never an error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integration.sglang.identity import model_key_name
from kvtier.keys import ChunkKey, KeySpace
from kvtier.memory import KVLayout
from kvtier.storage import StorageManager

__all__ = ["KVTierHiCacheStorage", "host_page_layout"]

logger = logging.getLogger(__name__)


def host_page_layout(pool: Any) -> KVLayout:
    """The kvtier layout of one host-pool page (`page_size` tokens); ConfigError if unknown."""
    page = int(pool.page_size)
    flat = pool.get_dummy_flat_data_page()
    layers = int(pool.layer_num)
    numel = flat.numel()
    if hasattr(pool, "kv_lora_rank"):  # MLA: one latent row per token and layer
        kv_dim, rem = divmod(numel, layers * page)
        if rem == 0:
            return KVLayout.mla(layers, kv_dim, flat.dtype)
    elif hasattr(pool, "head_num"):
        hidden, rem = divmod(numel, 2 * layers * page)
        heads = int(pool.head_num)
        if rem == 0 and hidden % heads == 0:
            return KVLayout.mha(layers, heads, hidden // heads, flat.dtype)
    raise ConfigError(f"kvtier HiCache storage: unsupported host pool {type(pool).__name__} "
                      f"({numel} values per page of {page} tokens, {layers} layers)")


class KVTierHiCacheStorage(HiCacheStorage):
    """HiCache L3 backed by kvtier's tiers. Keys are page hashes; values are host-pool pages.

    Args (as SGLang's dynamic backend factory passes them):
        storage_config: ranks, model name and `extra_config`; `extra_config["kvtier_config_file"]`
            names the kvtier YAML (else `KVTIER_CONFIG_FILE` / `LMCACHE_CONFIG_FILE`).
        kwargs: unused (SGLang passes its factory keyword arguments here).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None):
        extra = storage_config.extra_config or {}
        self.config = load_config(extra.get("kvtier_config_file"))
        self.storage_config = storage_config
        self._writes = storage_config.is_storage_writer
        self._model = model_key_name(storage_config.model_name or "model")
        mla = storage_config.is_mla_model
        self._rank = "0of1" if mla else f"{storage_config.tp_rank}of{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            self._rank += f"-pp{storage_config.pp_rank}of{storage_config.pp_size}"
        self.storage: StorageManager | None = None
        self.layout: KVLayout | None = None
        self.page_size = 0
        self._space = KeySpace("", "")

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host pool; builds the storage stack for its page layout."""
        super().register_mem_pool_host(mem_pool_host)
        layout = host_page_layout(mem_pool_host)
        if self.storage is not None:
            if layout != self.layout:
                raise ConfigError("kvtier HiCache storage: host pool layout changed")
            return
        self.layout = layout
        self.page_size = int(mem_pool_host.page_size)
        host_layout = str(getattr(mem_pool_host, "layout", "flat"))
        self._space = KeySpace(f"{self._model}@hicache-{host_layout}",
                               layout.fingerprint(self.page_size), self._rank,
                               self.config.key_namespace)
        self.storage = StorageManager(self.config, layout)
        logger.info("kvtier HiCache storage: %s, tiers %s", self._space.prefix,
                    self.config.tiers)

    # ---- keys ----

    def _keys(self, keys: Sequence[str],
              extra_info: HiCacheStorageExtraInfo | None = None) -> list[ChunkKey]:
        prev = None
        if extra_info is not None and extra_info.prefix_keys:
            prev = extra_info.prefix_keys[-1]
        return self._space.opaque_keys(keys, self.page_size, prev, self.config.hash_salt)

    def _ready(self) -> StorageManager:
        if self.storage is None:
            raise RuntimeError("kvtier HiCache storage used before register_mem_pool_host()")
        return self.storage

    # ---- page copies ----

    def _read_pages(self, keys: list[ChunkKey], dests: Sequence[Any]) -> int:
        """Copy the leading hits of `keys` into `dests[i](flat_page)`; returns how many."""
        with self._ready().get(keys) as objs:
            for obj, put in zip(objs, dests, strict=False):
                put(obj.tensor.view(-1))
            return len(objs)

    def _write_pages(self, keys: list[ChunkKey], pages: Sequence[torch.Tensor]) -> bool:
        storage = self._ready()
        if not self._writes:  # MLA: one writer for replicated KV
            return True
        assert self.layout is not None
        objs = []
        try:
            for page in pages:
                obj = storage.allocator.allocate(self.layout, self.page_size)
                if obj is None:
                    break
                objs.append(obj)
                obj.tensor.view(-1).copy_(page.reshape(-1))
            storage.put(keys[: len(objs)], objs)
        finally:
            for obj in objs:
                obj.release()
        return len(objs) == len(keys)

    # ---- HiCacheStorage, zero-copy interface (extra_config "interface_v1": 1) ----

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of `keys` some kvtier tier holds."""
        return self._ready().contains(self._keys(keys, extra_info))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load pages into the host pool at `host_indices` (one page per key, in order)."""
        pool = self.mem_pool_host
        page = self.page_size
        dests = [lambda flat, i=i: pool.set_from_flat_data_page(int(host_indices[i * page]), flat)
                 for i in range(len(keys))]
        n = self._read_pages(self._keys(keys, extra_info), dests)
        return [True] * n + [False] * (len(keys) - n)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store host-pool pages at `host_indices` under `keys`; lower tiers in the background."""
        pool = self.mem_pool_host
        pages = [pool.get_data_page(int(host_indices[i * self.page_size]), flat=True)
                 for i in range(len(keys))]
        ckeys = self._keys(keys, extra_info)
        ok = self._write_pages(ckeys, pages)
        stored = len(keys) if ok else self._ready().contains(ckeys)
        return [True] * stored + [False] * (len(keys) - stored)

    # ---- HiCacheStorage, copying interface ----

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The page stored under `key` copied into `target_location` (or a new tensor), or
        None on a miss."""
        out: list[torch.Tensor] = []

        def put(flat: torch.Tensor) -> None:
            if target_location is None:
                out.append(flat.clone())
            else:
                target_location.view(-1).copy_(flat)
                out.append(target_location)

        self._read_pages(self._keys([key]), [put])
        return out[0] if out else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        targets = target_locations or [None] * len(keys)
        out: list[Any] = []
        for key, target in zip(keys, targets, strict=True):
            got = self.get(key, target)
            out.append(got)
            if got is None:  # prefix semantics: nothing after a miss is usable
                out.extend([None] * (len(keys) - len(out)))
                break
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        if value is None:
            raise ValueError("value must be a page tensor")
        return self._write_pages(self._keys([key]), [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("values must hold one page tensor per key")
        return self._write_pages(self._keys(keys), list(values))

    def exists(self, key: str) -> bool:
        return self._ready().contains(self._keys([key])) == 1

    def clear(self) -> None:
        """Not supported: kvtier tiers may be shared; use `kvtier purge`."""
        logger.info("kvtier HiCache storage: clear() ignored (tiers may be shared)")

    def get_stats(self) -> dict[str, float] | None:
        return None if self.storage is None else self.storage.stats()

    def close(self) -> None:
        """Drain background writes and release the tiers. Idempotent."""
        if self.storage is not None:
            self.storage.close()
