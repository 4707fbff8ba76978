"""kvtier as an L3 for SGLang's hierarchical cache (HiCache): `--hicache-storage-backend dynamic`.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integration.sglang.hicache.storage",
        "class_name": "KVTierHiCacheStorage", "interface_v1": 1,
        "kvtier_config_file": "/etc/kvtier.yaml"}'

HiCache moves pages between its host pool and the L3 by page hash (SGLang's chained SHA-256 of
the prefix), never by token ids, so each page is stored as one kvtier chunk under
`kvtier/v2/{namespace}/{model}/hicache-{host layout}-{layout fingerprint}/{rank}of{world}/{page
hash}` (with `hash_salt`, a salted digest of the page hash). `{model}` is the radix-cache
backend's model identity (`identity.model_identity`: the served name and a fingerprint of the
weights, config.json, revision, dtypes...), read from SGLang's server args in this process; a
backend that cannot make it refuses to start. The record's token field, which kvtier verifies on
every read, then carries bytes derived from the page hash. Reads and writes go through kvtier's
engine's PageStore, so the tiers (CPU, disk, Redis), write policy and failure handling are kvtier's:
a tier that fails is a miss, never an error.

Multimodal input: the radix-cache backend keeps requests with images, audio or video out of
kvtier (`requests.multimodal`). HiCache gives its L3 no request: `batch_exists`,
`batch_get_v1` and `batch_set_v1` see page hashes (and the hashes before them) only, so a page
of an image request cannot be told from a text page. Those hashes cover the items' pad values,
which derive from an item hash a client may choose (`mm_hashes`), so one client could name its
own image's KV after another's: in kvtier's shared, long-lived tiers that is poisoning. The
backend therefore refuses to start for a model SGLang serves with multimodal input
(`ModelConfig.is_multimodal`); serve such a model with `--enable-kvtier` (the radix-cache
backend, which bypasses multimodal requests one by one) instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtier.config import load_config, with_overrides
from kvtier.engine import PageStore
from kvtier.errors import ConfigError
from kvtier.integration.sglang.boundary.sglang_views import (
    HiCacheStorageConfigView,
    HiCacheStorageExtraInfoView,
    HostPoolView,
    LayeredHostPoolView,
    MHAHostPoolView,
    ModelConfigView,
    Opaque,
    ServerArgsView,
)
from kvtier.integration.sglang.launch.identity import model_identity
from kvtier.keys import ChunkKey, KeySpace
from kvtier.keys.record_keys import name_salt
from kvtier.memory import KVLayout

__all__ = ["KVTierHiCacheStorage", "host_page_layout", "hicache_model"]

logger = logging.getLogger(__name__)


def _server_args() -> ServerArgsView | None:
    """SGLang's server args in this process (the scheduler publishes them before it builds
    its cache), or None where nobody published them."""
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args: ServerArgsView = get_server_args()
    except ValueError:  # "Global server args is not set yet!"
        return None
    return server_args


def _takes_multimodal_input(server_args: ServerArgsView) -> bool:
    """Whether SGLang serves this model with multimodal input (its own `ModelConfig` answer:
    the architecture, sub-configs and `--enable-multimodal`)."""
    from sglang.srt.configs.model_config import ModelConfig

    try:
        model_config: ModelConfigView = ModelConfig.from_server_args(server_args)
        return bool(model_config.is_multimodal)
    except Exception as exc:  # an unreadable config: refuse rather than guess
        raise ConfigError(f"kvtier HiCache storage: cannot tell whether model "
                          f"{server_args.model_path!r} takes multimodal input "
                          f"({type(exc).__name__}: {exc}); kvtier refuses to store its pages "
                          f"without knowing") from None


def hicache_model(server_args: ServerArgsView | None, fingerprint: str | None = None) -> str:
    """The model key component of the HiCache backend: the same identity as the radix-cache
    backend's (`identity.model_identity`).

    Raises:
        ConfigError: no server args (nothing to fingerprint the model by: keys by name alone
            would share KV across weights, revisions and dtypes), or a model served with
            multimodal input (see the module docstring).
    """
    if server_args is None:
        raise ConfigError(
            "kvtier HiCache storage: SGLang's server args are not published in this process "
            "(sglang.srt.runtime_context.get_server_args()), so the model's fingerprint "
            "(weights, config.json, revision, dtypes) cannot be made; kvtier refuses to key "
            "pages by the model name alone")
    model = model_identity(server_args, fingerprint)
    if _takes_multimodal_input(server_args):
        raise ConfigError(
            f"kvtier HiCache storage: model {server_args.model_path!r} takes multimodal input, "
            "and HiCache hands its storage page hashes only, so kvtier cannot keep image, audio "
            "and video requests out of its shared tiers (their pages are keyed by item hashes "
            "a client may choose); use --enable-kvtier (the radix-cache backend, which bypasses "
            "multimodal requests) for this model")
    return model


def host_page_layout(pool: HostPoolView) -> KVLayout:
    """The kvtier layout of one host-pool page (`page_size` tokens); ConfigError if unknown."""
    page = int(pool.page_size)
    flat = pool.get_dummy_flat_data_page()
    layers = int(cast(LayeredHostPoolView, pool).layer_num)
    numel = flat.numel()
    if hasattr(pool, "kv_lora_rank"):  # MLA: one latent row per token and layer
        kv_dim, rem = divmod(numel, layers * page)
        if rem == 0:
            return KVLayout.mla(layers, kv_dim, flat.dtype)
    elif hasattr(pool, "head_num"):
        hidden, rem = divmod(numel, 2 * layers * page)
        heads = int(cast(MHAHostPoolView, pool).head_num)
        if rem == 0 and hidden % heads == 0:
            return KVLayout.mha(layers, heads, hidden // heads, flat.dtype)
    raise ConfigError(f"kvtier HiCache storage: unsupported host pool {type(pool).__name__} "
                      f"({numel} values per page of {page} tokens, {layers} layers)")


class KVTierHiCacheStorage(HiCacheStorage):
    """HiCache L3 backed by kvtier's tiers. Keys are page hashes; values are host-pool pages.

    Args (as SGLang's dynamic backend factory passes them):
        storage_config: ranks and `extra_config`; `extra_config["kvtier_config_file"]` names
            the kvtier YAML (else `KVTIER_CONFIG_FILE` / `LMCACHE_CONFIG_FILE`);
            `extra_config["verify_fraction"]` replaces the file's (SGLang's
            `PUT /hicache/storage-backend` carries it: the share changes at run time). The
            model is named from SGLang's server args (`hicache_model`), not its `model_name`.
        kwargs: unused (SGLang passes its factory keyword arguments here).

    Raises:
        ConfigError: a bad kvtier config, or a model `hicache_model` refuses.
    """

    mem_pool_host: HostPoolView  # set by HiCacheStorage.register_mem_pool_host

    def __init__(self, storage_config: HiCacheStorageConfigView, kwargs: Opaque = None):
        extra = storage_config.extra_config or {}
        self.config = load_config(extra.get("kvtier_config_file"))
        if "verify_fraction" in extra:  # the one kvtier key SGLang's attach route may change
            self.config = with_overrides(self.config, {"verify_fraction": extra["verify_fraction"]},
                                         "hicache_storage_backend_extra_config")
            logger.info("kvtier HiCache storage: verify_fraction %g (from the extra config)",
                        self.config.verify_fraction)
        if self.config.verify_fraction > 0 and self.config.verify_scope != "full":
            logger.warning("kvtier: verify_scope %s applies to --enable-kvtier (the radix-cache "
                           "backend); in the HiCache storage mode a sampled query is verified "
                           "in full", self.config.verify_scope)
        if self.config.enable_blending:
            logger.warning("kvtier: enable_blending is ignored in the HiCache storage mode "
                           "(--hicache-storage-backend kvtier): blending runs with "
                           "--enable-kvtier (the radix-cache backend)")
        self._name_salt = name_salt(self.config.hash_salt, self.config.record_key_file)
        self.storage_config = storage_config
        self._writes = storage_config.is_storage_writer
        self._model = hicache_model(_server_args(), self.config.model_fingerprint)
        mla = storage_config.is_mla_model
        self._rank = "0of1" if mla else f"{storage_config.tp_rank}of{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            self._rank += f"-pp{storage_config.pp_rank}of{storage_config.pp_size}"
        self.pages: PageStore | None = None
        self.layout: KVLayout | None = None
        self.page_size = 0
        self._space = KeySpace("", "")

    def register_mem_pool_host(self, mem_pool_host: HostPoolView) -> None:
        """Bind the host pool; builds the storage stack for its page layout."""
        super().register_mem_pool_host(mem_pool_host)
        layout = host_page_layout(mem_pool_host)
        if self.pages is not None:
            if layout != self.layout:
                raise ConfigError("kvtier HiCache storage: host pool layout changed")
            return
        self.layout = layout
        self.page_size = int(mem_pool_host.page_size)
        host_layout = str(getattr(mem_pool_host, "layout", "flat"))
        tag = getattr(mem_pool_host, "storage_format_tag", None)  # a page format of its own
        if tag:
            host_layout += f"-{tag}"
        self._space = KeySpace(self._model,
                               f"hicache-{host_layout}-{layout.fingerprint(self.page_size)}",
                               self._rank, self.config.key_namespace)
        self.pages = PageStore(self.config, layout, self.page_size, writes=self._writes)
        logger.info("kvtier HiCache storage: %s, tiers %s", self._space.prefix,
                    self.config.tiers)

    # ---- keys ----

    def _keys(self, keys: Sequence[str],
              extra_info: HiCacheStorageExtraInfoView | None = None) -> list[ChunkKey]:
        prev = None
        if extra_info is not None and extra_info.prefix_keys:
            prev = extra_info.prefix_keys[-1]
        return self._space.opaque_keys(keys, self.page_size, prev, self._name_salt)

    def _ready(self) -> PageStore:
        if self.pages is None:
            raise RuntimeError("kvtier HiCache storage used before register_mem_pool_host()")
        return self.pages

    # ---- HiCacheStorage, zero-copy interface (extra_config "interface_v1": 1) ----

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfoView | None = None) -> int:
        """How many leading pages of `keys` some kvtier tier holds (none for a query sampled
        for shadow verification: `PageStore.lookup`)."""
        return self._ready().lookup(self._keys(keys, extra_info))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfoView | None = None) -> list[bool]:
        """Load pages into the host pool at `host_indices` (one page per key, in order)."""
        pool = self.mem_pool_host
        page = self.page_size
        dests = [lambda flat, i=i: pool.set_from_flat_data_page(int(host_indices[i * page]), flat)
                 for i in range(len(keys))]
        n = self._ready().read(self._keys(keys, extra_info), dests)
        return [True] * n + [False] * (len(keys) - n)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfoView | None = None) -> list[bool]:
        """Store host-pool pages at `host_indices` under `keys`; lower tiers in the background."""
        pool = self.mem_pool_host
        pages = [pool.get_data_page(int(host_indices[i * self.page_size]), flat=True)
                 for i in range(len(keys))]
        ckeys = self._keys(keys, extra_info)
        ok = self._ready().write(ckeys, pages)
        stored = len(keys) if ok else self._ready().held(ckeys)
        return [True] * stored + [False] * (len(keys) - stored)

    # ---- HiCacheStorage, copying interface ----

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Opaque = None) -> torch.Tensor | None:
        """The page stored under `key` copied into `target_location` (or a new tensor), or
        None on a miss."""
        out: list[torch.Tensor] = []

        def put(flat: torch.Tensor) -> None:
            if target_location is None:
                out.append(flat.clone())
            else:
                target_location.view(-1).copy_(flat)
                out.append(target_location)

        self._ready().read(self._keys([key]), [put])
        return out[0] if out else None

    def batch_get(self, keys: list[str],
                  target_locations: Sequence[torch.Tensor | None] | None = None,
                  target_sizes: Opaque = None) -> list[torch.Tensor | None]:
        targets = target_locations or [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for key, target in zip(keys, targets, strict=True):
            got = self.get(key, target)
            out.append(got)
            if got is None:  # prefix semantics: nothing after a miss is usable
                out.extend([None] * (len(keys) - len(out)))
                break
        return out

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Opaque = None,
            target_sizes: Opaque = None) -> bool:
        if value is None:
            raise ValueError("value must be a page tensor")
        return self._ready().write(self._keys([key]), [value])

    def batch_set(self, keys: list[str], values: Sequence[torch.Tensor] | None = None,
                  target_locations: Opaque = None, target_sizes: Opaque = None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("values must hold one page tensor per key")
        return self._ready().write(self._keys(keys), list(values))

    def exists(self, key: str) -> bool:
        return self._ready().lookup(self._keys([key])) == 1

    def clear(self) -> None:
        """Not supported: kvtier tiers may be shared; use `kvtier purge`."""
        logger.info("kvtier HiCache storage: clear() ignored (tiers may be shared)")

    def get_stats(self) -> dict[str, float] | None:
        return None if self.pages is None else self.pages.stats()

    def close(self) -> None:
        """Drain background writes and release the tiers. Idempotent."""
        if self.pages is not None:
            self.pages.close()
