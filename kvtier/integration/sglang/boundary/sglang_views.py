"""Typed views of the SGLang objects kvtier reads: one `Protocol` per SGLang class (or family)
with exactly the members kvtier's integration code uses, so mypy refuses a read a view does not
declare (issue 37). Type-only: nothing here is checked at run time, and SGLang's objects are
never wrapped. `view_of` names the SGLang classes each view describes (`VIEWS`); every member
is listed under one of them in `sglang_api.SURFACE`, which the canary checks against the
installed SGLang. Import them from `sglang_api`, which re-exports them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

__all__ = ["Opaque", "VIEWS", "view_of", "ReqView", "RadixKeyView", "MatchPrefixParamsView",
           "InitLoadBackParamsView", "MatchResultView", "KVAllocatorView", "TreeCoreView",
           "AttnGroupsView", "SchedulerView", "ForwardModeView", "ScheduleBatchView",
           "ServerArgsView", "LaunchArgsView", "CacheInitParamsView",
           "TreeCacheBuildContextView", "MHAPoolView", "MLAPoolView", "HostPoolView",
           "LayeredHostPoolView", "MHAHostPoolView", "HiCacheStorageConfigView",
           "HiCacheStorageExtraInfoView", "StorageReqInputView", "StorageReqOutputView",
           "TokenizerManagerView", "ModelConfigView", "GlobalStateView"]

# An object SGLang hands over and kvtier passes back without reading it (a tree node, a lock
# handle, a hook's result): the one place `Any` stands for an SGLang object.
Opaque = Any

VIEWS: dict[str, tuple[str, ...]] = {}  # view (Protocol) name -> the SGLang classes it views
_C = TypeVar("_C", bound=type)


def view_of(*owners: str) -> Callable[[_C], _C]:
    """Record which SGLang classes (dotted paths) a Protocol view describes (`VIEWS`)."""
    def record(cls: _C) -> _C:
        VIEWS[cls.__name__] = owners
        return cls
    return record


_SB = "sglang.srt.managers.schedule_batch"
_BPC = "sglang.srt.mem_cache.base_prefix_cache"
_HIC = "sglang.srt.mem_cache.hicache_storage"
_IO = "sglang.srt.managers.io_struct"


@view_of(f"{_SB}.Req")
class ReqView(Protocol):
    """A request (`Req`): what kvtier's tree reads to load, store and bypass it."""

    rid: str
    last_node: Opaque  # the tree node ending its device prefix
    prefix_len: int
    finished_reason: object  # an instance of FINISH_ABORT when it was aborted
    extra_key: str | None  # LoRA adapter and friends: such requests bypass kvtier
    cache_salt: str | None
    full_untruncated_fill_ids: Sequence[int]
    origin_input_ids: Sequence[int]
    skip_radix_cache_insert: bool  # set: its KV never enters the tree, it is freed at release
    # what SGLang counts in `cached_tokens` (`prefix_len - already_computed`, when its prefill
    # is prepared) and its breakdown (set once): a blend corrects them (blend_hooks.py)
    already_computed: int
    cached_tokens_device: int
    cached_tokens_host: int
    _cache_breakdown_computed: bool

    def finished(self) -> bool: ...


@view_of("sglang.srt.mem_cache.radix_cache.RadixKey")
class RadixKeyView(Protocol):
    """A match key (`RadixKey`)."""

    extra_key: str | None
    is_bigram: bool
    cache_salt: str | None

    def raw_token_ids(self) -> Sequence[int]: ...

    def __len__(self) -> int: ...

    def __getitem__(self, idx: slice) -> RadixKeyView: ...


@view_of(f"{_BPC}.MatchPrefixParams")
class MatchPrefixParamsView(Protocol):
    key: RadixKeyView
    req: ReqView | None


@view_of(f"{_BPC}.InitLoadBackParams")
class InitLoadBackParamsView(Protocol):
    req: ReqView | None
    host_hit_length: int


@view_of(f"{_BPC}.MatchResult")
class MatchResultView(Protocol):
    """`MatchResult`, a NamedTuple: kvtier reports its host hit through `_replace`."""

    device_prefix_len: int
    last_device_node: Opaque
    host_hit_length: int

    def _replace(self, **fields: Any) -> MatchResultView: ...


@view_of("sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator")
class KVAllocatorView(Protocol):
    """The tree's `token_to_kv_pool_allocator`."""

    def alloc(self, need_size: int) -> torch.Tensor | None: ...

    def free(self, free_index: torch.Tensor) -> None: ...

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> bool | None: ...

    def get_kvcache(self) -> object: ...  # the device KV pool (MHAPoolView / MLAPoolView)


@view_of("sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore")
class TreeCoreView(Protocol):
    is_eagle: bool  # EAGLE's bigram keys: such trees bypass kvtier's prefetch


@view_of("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache")
class AttnGroupsView(Protocol):
    def _all_reduce_attn_groups(self, tensor: torch.Tensor, op: Any) -> None: ...


@view_of("sglang.srt.managers.scheduler.Scheduler")
class SchedulerView(Protocol):
    """The scheduler, as the plugin's hooks and the admin handlers see it."""

    tree_cache: object  # kvtier's tree carries `.kvtier`; other trees do not
    enable_lmcache: bool  # gates the storage-prefetch hooks (`enable_storage_prefetch`)
    # An admin op's answers gathered over the TP group (`tp_answers.py`)
    tp_size: int
    tp_cpu_group: Opaque
    server_args: ServerArgsView


@view_of("sglang.srt.model_executor.forward_batch_info.ForwardMode")
class ForwardModeView(Protocol):
    def is_extend(self) -> bool: ...


@view_of(f"{_SB}.ScheduleBatch")
class ScheduleBatchView(Protocol):
    forward_mode: ForwardModeView
    extend_num_tokens: int


@view_of("sglang.srt.server_args.ServerArgs")
class ServerArgsView(Protocol):
    """SGLang's server args: the model identity reads the rest by name (`identity.py`)."""

    model_path: str
    enable_dp_attention: bool  # control requests may then skip the TP group's broadcast
    max_total_tokens: int | None  # the CPU engine's KV pool at launch (preflight.py)


@view_of("sglang.srt.server_args.ServerArgs")
class LaunchArgsView(ServerArgsView, Protocol):
    """The launcher's parsed flags (an argparse namespace of ServerArgs fields) that
    `--enable-kvtier` rewrites; the others are read by name."""

    radix_cache_backend: str | None


@view_of("sglang.srt.mem_cache.cache_init_params.CacheInitParams")
class CacheInitParamsView(Protocol):
    page_size: int
    token_to_kv_pool_allocator: KVAllocatorView
    # --kv-events-config: what the tree's event recorder is made with (tier_events.py)
    enable_kv_cache_events: bool
    dynamo_kv_event_format: bool
    kv_event_lora_names: Opaque


@view_of("sglang.srt.mem_cache.registry.TreeCacheBuildContext")
class TreeCacheBuildContextView(Protocol):
    """What a radix-cache factory is handed (`build_radix_cache`)."""

    params: CacheInitParamsView
    server_args: ServerArgsView
    tp_size: int
    tp_rank: int


@view_of("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool")
class MHAPoolView(Protocol):
    k_buffer: list[torch.Tensor]
    v_buffer: list[torch.Tensor]


@view_of("sglang.srt.mem_cache.memory_pool.MLATokenToKVPool")
class MLAPoolView(Protocol):
    kv_buffer: list[torch.Tensor]


@view_of("sglang.srt.mem_cache.pool_host.base.HostKVCache")
class HostPoolView(Protocol):
    """A HiCache host pool, as its L3 backend reads and fills pages."""

    page_size: int

    def get_dummy_flat_data_page(self) -> torch.Tensor: ...

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor: ...

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None: ...


@view_of("sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost",
         "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost")
class LayeredHostPoolView(HostPoolView, Protocol):
    layer_num: int


@view_of("sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost")
class MHAHostPoolView(LayeredHostPoolView, Protocol):
    head_num: int


@view_of(f"{_HIC}.HiCacheStorageConfig")
class HiCacheStorageConfigView(Protocol):
    """What SGLang's storage-backend factory hands a HiCache L3 backend."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    is_mla_model: bool
    extra_config: dict[str, Any] | None

    @property
    def is_storage_writer(self) -> bool: ...


@view_of(f"{_HIC}.HiCacheStorageExtraInfo")
class HiCacheStorageExtraInfoView(Protocol):
    prefix_keys: list[str] | None  # the page hashes before a call's keys


@view_of(f"{_IO}.AttachHiCacheStorageReqInput")
class StorageReqInputView(Protocol):
    """The HiCache attach channel's request (kvtier's admin operations ride on it)."""

    hicache_storage_backend: str | None
    hicache_storage_backend_extra_config_json: str | None


@view_of(f"{_IO}.AttachHiCacheStorageReqOutput", f"{_IO}.DetachHiCacheStorageReqOutput")
class StorageReqOutputView(Protocol):
    success: bool
    message: str


@view_of("sglang.srt.managers.tokenizer_manager.TokenizerManager")
class TokenizerManagerView(Protocol):
    attach_hicache_storage_communicator: Callable[[Any], Awaitable[list[StorageReqOutputView]]]

    def auto_create_handle_loop(self) -> None: ...


@view_of("sglang.srt.configs.model_config.ModelConfig")
class ModelConfigView(Protocol):
    is_multimodal: bool  # the HiCache backend refuses such models


@view_of("sglang.srt.entrypoints.http_server._GlobalState")
class GlobalStateView(Protocol):
    tokenizer_manager: TokenizerManagerView
