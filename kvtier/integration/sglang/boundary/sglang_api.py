"""Every piece of SGLang kvtier relies on beyond its documented plugin API, in one place.

kvtier is written against SGLang 0.5.23. Each `ReachIn` of sglang_canary.py names one internal
(a private attribute, a hook target, a method signature, a field) with what kvtier needs it
for, and a check that it is still there in the installed SGLang. `check_all()` runs them all:
the test suite's canary (tests/integration/sglang/boundary/test_sglang_api.py) and
`kvtier info` call it, so an SGLang upgrade that moves any of them fails loudly, naming it,
instead of misbehaving at run time.

The typed boundary (issue 37): each SGLang object kvtier reads is typed by a `Protocol` view
(sglang_views.py: `ReqView`, `SchedulerView`, ...; `VIEWS` names the SGLang classes each
views), so mypy refuses a read no view declares. `SURFACE` lists every SGLang module, class,
attribute, method, field and keyword argument the integration code touches: the ast scan of
tests/integration/sglang/boundary/test_sglang_boundary.py fails on a touch it lacks (or a
stale entry), and the canary checks each listed name exists. `Any` stays only for objects
SGLang hands over and kvtier passes back unread (`Opaque`).

The helpers at the bottom are the reach-ins kvtier's code makes outside the radix-cache
subclass (which reaches its own base class's methods directly; they are listed here too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.integration.sglang.boundary.sglang_views import (
    VIEWS,
    AttnGroupsView,
    GlobalStateView,
    SchedulerView,
    TokenizerManagerView,
)

if TYPE_CHECKING:
    import torch

__all__ = ["HOOK_TARGETS", "SURFACE", "VIEWS", "NOT_SGLANG", "CALLED_BY_SGLANG",
           "enable_storage_prefetch", "all_reduce", "tokenizer_manager"]

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
# Hook targets of the plugin (SGLang's HookRegistry patches them by dotted path).
HOOK_TARGETS = {
    "add_cli_args": f"{SERVER_ARGS}.add_cli_args",
    "from_cli_args": f"{SERVER_ARGS}.from_cli_args",
    "scheduler_init": f"{SCHEDULER}.__init__",
    "process_batch_result": f"{SCHEDULER}.process_batch_result",
    "run_batch": f"{SCHEDULER}.run_batch",
    "on_idle": f"{SCHEDULER}.on_idle",
    "attach": f"{SCHEDULER}.attach_hicache_storage_wrapped",
    "detach": f"{SCHEDULER}.detach_hicache_storage_wrapped",
    "launch_server": "sglang.srt.entrypoints.http_server.launch_server",
}


# ---- every SGLang name kvtier's integration code touches, in one table ----

_SB = "sglang.srt.managers.schedule_batch"
_BPC = "sglang.srt.mem_cache.base_prefix_cache"
_HIC = "sglang.srt.mem_cache.hicache_storage"
_IO = "sglang.srt.managers.io_struct"

# owner (an SGLang module or class, dotted) -> the names kvtier uses on it: imports, attributes
# and methods (read through a view above, by `getattr`/`hasattr`, or inherited by kvtier's
# subclasses), methods kvtier's subclasses override, dataclass fields and keyword arguments it
# passes. tests/integration/sglang/boundary/test_sglang_boundary.py keeps this equal to what
# the code touches; the canary (`check_all`) checks each name exists in the installed SGLang.
SURFACE: dict[str, tuple[str, ...]] = {
    # -- the plugin: flags, hooks, the radix-cache registry, HTTP routes --
    "sglang.srt.server_args.ServerArgs": (
        "add_cli_args", "from_cli_args",  # hook targets
        "radix_cache_backend", "device", "page_size", "tp_size", "dp_size", "load_format",
        "enable_hierarchical_cache", "disable_radix_cache",  # launch checks (flags.py)
        "served_model_name", "model_path", "revision", "quantization", "dtype",
        "json_model_override_args", "kv_cache_dtype",  # the model identity (identity.py)
        "max_total_tokens",  # the CPU engine's memory at launch (preflight.py)
        "enable_dp_attention",  # an admin op's answers gathered or not (tp_answers.py)
    ),
    "sglang.srt.plugins.hook_registry": ("HookRegistry", "HookType"),
    "sglang.srt.plugins.hook_registry.HookRegistry": ("register",),
    "sglang.srt.plugins.hook_registry.HookType": ("BEFORE", "AFTER", "AROUND"),
    "sglang.srt.managers.scheduler.Scheduler": (
        "__init__", "process_batch_result", "run_batch", "on_idle",
        "attach_hicache_storage_wrapped", "detach_hicache_storage_wrapped",  # hook targets
        "tree_cache", "server_args", "waiting_queue", "enable_lmcache",
        "tokenizer",  # the separator's token ids (blending)
        "tp_size", "tp_cpu_group",  # an admin op's answers gathered (tp_answers.py)
    ),
    f"{_SB}.ScheduleBatch": ("forward_mode", "extend_num_tokens", "launch_ts", "seq_lens_cpu"),
    "sglang.srt.model_executor.forward_batch_info.ForwardMode": ("is_extend", "EXTEND"),
    # -- a blend's rows through SGLang's model before admission (rows_forward.py) --
    "sglang.srt.model_executor": ("forward_context",),
    "sglang.srt.model_executor.forward_context": ("ForwardContext", "get_forward_context"),
    "sglang.srt.model_executor.forward_context.ForwardContext": ("attn_backend",),
    "sglang.srt.model_executor.forward_batch_info": ("ForwardBatch", "ForwardMode"),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch": (  # its fields
        "forward_mode", "batch_size", "input_ids", "req_pool_indices", "seq_lens",
        "out_cache_loc", "seq_lens_sum", "seq_lens_cpu", "positions", "extend_num_tokens",
        "extend_seq_lens", "extend_prefix_lens", "extend_seq_lens_cpu",
        "extend_prefix_lens_cpu", "extend_start_loc"),
    "sglang.srt.mem_cache.memory_pool.KVWriteLoc": ("loc",),  # where set_kv_buffer writes
    "sglang.srt.mem_cache.registry": ("register_radix_cache_backend",
                                      "registered_radix_cache_backends",
                                      "create_unified_radix_cache"),
    "sglang.srt.mem_cache.registry.create_unified_radix_cache": ("cache_class",),
    "sglang.srt.mem_cache.registry.TreeCacheBuildContext": (
        "params", "server_args", "tp_size", "tp_rank", "is_hybrid_swa", "is_hybrid_ssm",
        "is_dsa", "enable_hierarchical_cache", "disable_radix_cache"),
    "sglang.srt.mem_cache.cache_init_params.CacheInitParams": (
        "page_size", "token_to_kv_pool_allocator", "pp_size", "enable_kv_cache_events",
        "dynamo_kv_event_format", "kv_event_lora_names"),
    "sglang.srt.entrypoints": ("http_server",),
    "sglang.srt.entrypoints.http_server": ("app", "_global_state", "launch_server"),
    "sglang.srt.entrypoints.http_server._GlobalState": ("tokenizer_manager",),
    "sglang.srt.managers.tokenizer_manager": ("TokenizerManager",),  # a stop's cut (http_stop)
    "sglang.srt.managers.tokenizer_manager.TokenizerManager": (
        "auto_create_handle_loop", "attach_hicache_storage_communicator",
        "_subprocess_watchdog"),  # stopped before kvtier's drain at exit (shutdown.py)
    _IO: ("AttachHiCacheStorageReqInput", "AttachHiCacheStorageReqOutput",  # the attach
          "DetachHiCacheStorageReqOutput"),  # channel's messages (the /kvtier/tiers routes)
    f"{_IO}.AttachHiCacheStorageReqInput": ("hicache_storage_backend",
                                            "hicache_storage_backend_extra_config_json"),
    f"{_IO}.AttachHiCacheStorageReqOutput": ("success", "message"),
    f"{_IO}.DetachHiCacheStorageReqOutput": ("success", "message"),
    "sglang.srt.utils.auth": ("AuthLevel", "auth_level"),
    # -- blending: the served model's own tensors (blend_model.py; REACH_INS check the rest) --
    "sglang.srt.sampling.sampling_params.SamplingParams": ("custom_params",),
    "sglang.srt.layers.linear.QKVParallelLinear": ("bias",),
    "sglang.srt.utils": ("use_intel_amx_backend",),  # the flag SGLang sets on packed layers
    "sglang.srt.utils.auth.AuthLevel": ("ADMIN_FORCE", "ADMIN_OPTIONAL"),
    # -- the radix-cache backend: kvtier's subclass of SGLang's unified tree --
    "sglang.srt.mem_cache.unified_radix_cache": ("UnifiedRadixCache",),
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache": (
        # overridden by KVTierRadixCache (an override SGLang no longer calls does nothing)
        "match_prefix", "init_load_back", "load_back_is_cache_owned", "is_backuped",
        "prefetch_from_storage", "check_prefetch_progress", "pop_prefetch_loaded_span",
        "release_aborted_request", "check_hicache_events",
        "clear_storage_backend", "checkpoint", "release_session", "evict", "evict_for_alloc",
        "reset", "shutdown", "release_host_resources", "on_release", "take_events",
        # (and has_pending_cache_operations: CALLED_BY_SGLANG)
        # inherited and used
        "disable", "tree_core", "token_to_kv_pool_allocator", "path_device_indices", "insert",
        "lock", "unlock", "protected_size", "_all_reduce_attn_groups",
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore": ("is_eagle",),
    # -- tier events (tier_events.py): SGLang's recorder hashes kvtier's chunks --
    "sglang.srt.mem_cache.events": ("KVCacheEventRecorder",),
    "sglang.srt.mem_cache.events.KVCacheEventRecorder": (  # its constructor's arguments
        "enabled", "page_size", "dynamo_format", "lora_names"),
    "sglang.srt.disaggregation.kv_events": ("BlockStored", "BlockRemoved"),
    "sglang.srt.disaggregation.kv_events.BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "cache_salt"),
    "sglang.srt.disaggregation.kv_events.BlockRemoved": ("block_hashes", "medium"),
    "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator": (
        "alloc", "free", "evict_to_free_tokens", "get_kvcache"),
    _BPC: ("EvictParams", "InsertParams", "MatchPrefixParams", "MatchResult"),
    f"{_BPC}.MatchPrefixParams": ("key", "req"),
    f"{_BPC}.InsertParams": ("key", "value", "prev_prefix_len", "inserted_len"),
    f"{_BPC}.InitLoadBackParams": ("req", "host_hit_length"),
    f"{_BPC}.MatchResult": ("device_prefix_len", "last_device_node", "host_hit_length",
                            "_replace"),
    "sglang.srt.mem_cache.radix_cache": ("RadixKey", "TreeNode"),
    "sglang.srt.mem_cache.radix_cache.RadixKey": ("extra_key", "is_bigram", "cache_salt",
                                                  "raw_token_ids", "__len__", "__getitem__"),
    _SB: ("FINISH_ABORT",),
    f"{_SB}.Req": ("rid", "last_node", "prefix_len", "finished_reason", "finished",
                   "extra_key", "cache_salt", "full_untruncated_fill_ids", "origin_input_ids",
                   "multimodal_inputs", "session", "sampling_params", "skip_radix_cache_insert",
                   # a blend's cached_tokens (blend_hooks._report_blend)
                   "already_computed", "cached_tokens_device", "cached_tokens_host",
                   "_cache_breakdown_computed"),
    "sglang.srt.session.session_controller.Session": ("session_id",),
    "sglang.srt.mem_cache.memory_pool": ("MHATokenToKVPool", "MLATokenToKVPool"),
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool": ("k_buffer", "v_buffer"),
    "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool": ("kv_buffer",),
    # -- the HiCache L3 backend --
    _HIC: ("HiCacheStorage",),
    f"{_HIC}.HiCacheStorage": (
        "mem_pool_host", "register_mem_pool_host",
        # overridden by KVTierHiCacheStorage
        "batch_exists", "batch_get_v1", "batch_set_v1", "get", "batch_get", "set",
        "batch_set", "exists", "clear", "get_stats"),  # (and close: CALLED_BY_SGLANG)
    f"{_HIC}.HiCacheStorageConfig": ("tp_rank", "tp_size", "pp_rank", "pp_size",
                                     "is_mla_model", "extra_config", "is_storage_writer"),
    f"{_HIC}.HiCacheStorageExtraInfo": ("prefix_keys",),
    "sglang.srt.mem_cache.pool_host.base.HostKVCache": (
        "page_size", "layout", "storage_format_tag", "get_dummy_flat_data_page",
        "get_data_page", "set_from_flat_data_page"),
    "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost": ("layer_num", "head_num"),
    "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost": ("layer_num", "kv_lora_rank"),
    "sglang.srt.runtime_context": ("get_server_args",),
    "sglang.srt.configs.model_config": ("ModelConfig",),
    "sglang.srt.configs.model_config.ModelConfig": ("from_server_args", "is_multimodal"),
}

# Methods kvtier's subclasses define that SGLang calls although the SGLang base class does not
# define them: name -> where SGLang calls it (REACH_INS checks that call is still there).
CALLED_BY_SGLANG: dict[str, str] = {
    "has_pending_cache_operations": "Scheduler, on its tree when enable_lmcache is on",
    "close": "HiCacheController, on its storage backend when it has one (detach, shutdown)",
}

# Names kvtier's integration code uses by name that are not SGLang's (the boundary test's scan
# cannot tell whose object a `getattr` reads): name -> whose it is.
NOT_SGLANG: dict[str, str] = {
    "attach_kvtier": "kvtier's own method on its tree (plugin.build_radix_cache calls it)",
    "attach_blender": "kvtier's own method on its tree (scheduler_hooks._enable_blending "
                      "calls it)",
    "publish_tier_events": "kvtier's own method on its tree (plugin.build_radix_cache calls "
                           "it with --kv-events-config)",
    "sliding_window": "the model's Hugging Face config (blending refuses sliding windows)",
    "use_sliding_window": "the model's Hugging Face config (Qwen2: whether the window applies)",
    "weight": "PyTorch's name for a layer's parameter (SGLang's linear layers register theirs "
              "under it: REACH_INS)",
    "kvtier": "kvtier's own: the engine on its tree, and the mark on its excepthook",
    "enable_kvtier": "kvtier's own flag on SGLang's parsed arguments "
                     "(flags.around_add_cli_args)",
    "kvtier_config_file": "kvtier's own flag on SGLang's parsed arguments",
    "path": "FastAPI's routes (`app.routes`: is /kvtier/tiers there already)",
    "uncancel": "asyncio's Task.uncancel (Python 3.11+; http_stop: a request the stop cut)",
}


# ---- the reach-ins kvtier's code makes (outside the radix-cache subclass) ----

def enable_storage_prefetch(scheduler: SchedulerView) -> None:
    """Make `scheduler` call its tree's storage-prefetch hooks (`Scheduler.enable_lmcache`
    gates them; the server args stay untouched, so SGLang never imports LMCache)."""
    scheduler.enable_lmcache = True


def all_reduce(cache: AttnGroupsView, tensor: torch.Tensor, op: Any) -> None:
    """All-reduce `tensor` over the tree's attention TP group (`_all_reduce_attn_groups`);
    `op` is a `torch.distributed.ReduceOp`."""
    cache._all_reduce_attn_groups(tensor, op)


def tokenizer_manager() -> TokenizerManagerView:
    """The launcher's tokenizer manager (`http_server._global_state`)."""
    from sglang.srt.entrypoints import http_server

    state: GlobalStateView = http_server._global_state
    return state.tokenizer_manager
