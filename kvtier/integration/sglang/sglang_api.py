"""Every piece of SGLang kvtier relies on beyond its documented plugin API, in one place.

kvtier is written against SGLang 0.5.23. Each `ReachIn` below names one internal (a private
attribute, a hook target, a method signature, a field) with what kvtier needs it for, and a
check that it is still there in the installed SGLang. `check_all()` runs them all: the test
suite's canary (tests/integration/test_sglang_api.py) and `kvtier info` call it, so an SGLang
upgrade that moves any of them fails loudly, naming it, instead of misbehaving at run time.

The helpers at the bottom are the reach-ins kvtier's code makes outside the radix-cache
subclass (which reaches its own base class's methods directly; they are listed here too).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["ReachIn", "REACH_INS", "check_all", "HOOK_TARGETS", "enable_storage_prefetch",
           "all_reduce", "tokenizer_manager"]

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
}


class ReachIn(NamedTuple):
    name: str
    why: str  # what kvtier uses it for, and the SGLang behaviour it relies on
    check: Callable[[], None]  # raises AssertionError (or ImportError) when it moved


def _resolve(path: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {path}")


def _has(path: str, *members: str) -> Callable[[], None]:
    def check() -> None:
        obj = _resolve(path)
        missing = [m for m in members if not hasattr(obj, m)]
        assert not missing, f"{path} has no {missing}"
    return check


def _params(path: str, *names: str) -> Callable[[], None]:
    def check() -> None:
        params = inspect.signature(_resolve(path)).parameters
        missing = [n for n in names if n not in params]
        assert not missing, f"{path} takes no {missing} (has {list(params)})"
    return check


def _source_has(path: str, *snippets: str) -> Callable[[], None]:
    def check() -> None:
        source = inspect.getsource(_resolve(path))
        missing = [s for s in snippets if s not in source]
        assert not missing, f"{path} no longer contains {missing}"
    return check


_CACHE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"

REACH_INS: tuple[ReachIn, ...] = (
    ReachIn("ServerArgs.add_cli_args / from_cli_args",
            "the --enable-kvtier and --kvtier-config-file flags (HookRegistry AROUND)",
            _has(SERVER_ARGS, "add_cli_args", "from_cli_args")),
    ReachIn("Scheduler hook targets",
            "turning on the prefetch gate, timing prefills, tier attach over HTTP",
            _has(SCHEDULER, "__init__", "process_batch_result", "run_batch", "on_idle",
                 "attach_hicache_storage_wrapped", "detach_hicache_storage_wrapped")),
    ReachIn("Scheduler.on_idle runs on each loop turn without a batch; waiting_queue",
            "on a CPU engine, lower-tier writers wait while requests are queued, not only "
            "while a batch runs (a BEFORE hook on on_idle, and process_batch_result's, read "
            "whether the scheduler's waiting_queue is empty)",
            _source_has(f"{SCHEDULER}.is_fully_idle", "len(self.waiting_queue) == 0")),
    ReachIn("Scheduler.run_batch(batch) runs one forward",
            "on a CPU engine, lower-tier writers wait from a batch's launch (a BEFORE hook) "
            "to its result (process_batch_result)",
            _params(f"{SCHEDULER}.run_batch", "batch")),
    ReachIn("Scheduler.process_batch_result(batch, result)",
            "prefill speed: a BEFORE hook reads the batch after its forward",
            _params(f"{SCHEDULER}.process_batch_result", "batch", "result")),
    ReachIn("Scheduler.enable_lmcache gates the storage-prefetch hooks",
            "kvtier sets it on its own schedulers so SGLang calls prefetch_from_storage and "
            "check_prefetch_progress (without importing LMCache)",
            _source_has(f"{SCHEDULER}._prefetch_kvcache", "self.enable_lmcache")),
    ReachIn("ScheduleBatch.launch_ts / seq_lens_cpu / extend_num_tokens / forward_mode",
            "the prefill speed estimate (tokens over launch-to-result time)",
            _source_has(f"{_BATCH}", "launch_ts", "seq_lens_cpu", "extend_num_tokens",
                        "forward_mode")),
    ReachIn("radix-cache registry",
            "the kvtier backend of --radix-cache-backend, built on SGLang's unified tree",
            _has("sglang.srt.mem_cache.registry", "register_radix_cache_backend",
                 "registered_radix_cache_backends", "create_unified_radix_cache")),
    ReachIn("create_unified_radix_cache(ctx, cache_class=...)",
            "building SGLang's own tree with kvtier's subclass",
            _params("sglang.srt.mem_cache.registry.create_unified_radix_cache", "ctx",
                    "cache_class")),
    ReachIn("UnifiedRadixCache methods kvtier's tree overrides",
            "background loads, admission-time loads (SGLang's HiCache/LMCache contract), "
            "stores at checkpoints, sessions, eviction, reset: an override of a method SGLang "
            "no longer calls would silently do nothing",
            _has(_CACHE, "match_prefix", "init_load_back", "load_back_is_cache_owned",
                 "is_backuped", "prefetch_from_storage", "check_prefetch_progress",
                 "pop_prefetch_loaded_span", "release_aborted_request", "check_hicache_events",
                 "clear_storage_backend", "checkpoint", "release_session", "evict",
                 "evict_for_alloc", "reset", "shutdown")),
    ReachIn("Scheduler calls the tree's has_pending_cache_operations when enable_lmcache",
            "/flush_cache works once finished stores have read their slots",
            _source_has(SCHEDULER, "has_pending_cache_operations()")),
    ReachIn("UnifiedRadixCache.prefetch_from_storage(..., extra_key, cache_salt)",
            "keys and bypass per request (cache_salt mixed into kvtier's keys)",
            _params(f"{_CACHE}.prefetch_from_storage", "new_input_tokens", "extra_key",
                    "cache_salt")),
    ReachIn("UnifiedRadixCache privates",
            "reading a request's pool slots, freeing room for a load, agreeing across TP "
            "ranks, the EAGLE bigram tree",
            _has(_CACHE, "path_device_indices", "_all_reduce_attn_groups", "insert", "lock",
                 "unlock")),
    ReachIn("InsertParams(prev_prefix_len=, inserted_len=) / MatchPrefixParams(key=)",
            "inserting loaded KV like computed KV without freeing the shared prefix",
            _source_has("sglang.srt.mem_cache.base_prefix_cache.InsertParams",
                        "prev_prefix_len", "inserted_len")),
    ReachIn("RadixKey(token_ids, extra_key, cache_salt=)",
            "re-keying the loaded prefix the way SGLang keyed the request",
            _params("sglang.srt.mem_cache.radix_cache.RadixKey.__init__", "extra_key",
                    "cache_salt")),
    ReachIn("Req.full_untruncated_fill_ids / multimodal_inputs / cache_salt / extra_key",
            "the tokens a finished request stores; multimodal requests bypass kvtier",
            _source_has("sglang.srt.managers.schedule_batch.Req.__init__",
                        "self.full_untruncated_fill_ids", "self.multimodal_inputs",
                        "self.cache_salt", "self.extra_key")),
    ReachIn("MHATokenToKVPool.k_buffer / v_buffer, MLATokenToKVPool.kv_buffer",
            "the connectors copy straight from SGLang's per-layer pool tensors",
            _source_has("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
                        "self.k_buffer", "self.v_buffer")),
    ReachIn("http_server._global_state.tokenizer_manager.attach_hicache_storage_communicator",
            "GET/POST /kvtier/tiers reach every TP rank's scheduler through the HiCache "
            "attach channel",
            _source_has("sglang.srt.managers.tokenizer_control_mixin",
                        "attach_hicache_storage_communicator")),
    ReachIn("io_struct Attach/DetachHiCacheStorageReq*",
            "the messages of that channel",
            _has("sglang.srt.managers.io_struct", "AttachHiCacheStorageReqInput",
                 "AttachHiCacheStorageReqOutput", "DetachHiCacheStorageReqOutput")),
    ReachIn("utils.auth AuthLevel.ADMIN_FORCE / ADMIN_OPTIONAL",
            "the admin routes refuse callers without --admin-api-key",
            _has("sglang.srt.utils.auth.AuthLevel", "ADMIN_FORCE", "ADMIN_OPTIONAL")),
    ReachIn("plugins.hook_registry HookRegistry / HookType",
            "how the plugin patches the targets above",
            _has("sglang.srt.plugins.hook_registry.HookType", "BEFORE", "AFTER", "AROUND")),
)


def check_all() -> list[str]:
    """Every reach-in that moved in the installed SGLang, as 'name: what is wrong'."""
    failed = []
    for item in REACH_INS:
        try:
            item.check()
        except (AssertionError, ImportError, AttributeError, TypeError, ValueError,
                OSError) as exc:
            failed.append(f"{item.name} ({item.why}): {type(exc).__name__}: {exc}")
    return failed


# ---- the reach-ins kvtier's code makes (outside the radix-cache subclass) ----

def enable_storage_prefetch(scheduler: Any) -> None:
    """Make `scheduler` call its tree's storage-prefetch hooks (`Scheduler.enable_lmcache`
    gates them; the server args stay untouched, so SGLang never imports LMCache)."""
    scheduler.enable_lmcache = True


def all_reduce(cache: Any, tensor: Any, op: Any) -> None:
    """All-reduce `tensor` over the tree's attention TP group (`_all_reduce_attn_groups`)."""
    cache._all_reduce_attn_groups(tensor, op)


def tokenizer_manager() -> Any:
    """The launcher's tokenizer manager (`http_server._global_state`)."""
    from sglang.srt.entrypoints import http_server

    return http_server._global_state.tokenizer_manager
