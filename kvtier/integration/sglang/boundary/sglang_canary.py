"""The canary: every SGLang internal kvtier reaches into (`sglang_api`'s table, and the
behaviours and signatures below), checked against the installed SGLang. `check_all()` names
each that moved; the test suite and `kvtier info` call it."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from kvtier.integration.sglang.boundary.sglang_api import SCHEDULER, SERVER_ARGS, SURFACE

__all__ = ["ReachIn", "REACH_INS", "check_all"]


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


def _all(*checks: Callable[[], None]) -> Callable[[], None]:
    def check() -> None:
        for one in checks:
            one()
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
    ReachIn("HiCacheController calls its storage backend's close() on detach and shutdown",
            "the HiCache backend drains its background writes and releases its tiers",
            _source_has("sglang.srt.managers.cache_controller.HiCacheController",
                        "self.storage_backend.close()")),
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
    ReachIn("the served Llama-family model's modules and tensors",
            "blending computes with the served model's own weights (blend_model.served_weights)",
            _source_has("sglang.srt.models.llama.LlamaAttention", "self.qkv_proj",
                        "self.o_proj", "self.rotary_emb", "self.num_heads", "self.num_kv_heads",
                        "self.head_dim")),
    ReachIn("Llama decoder layers, MLP and model",
            "blending reads each layer's norms and MLP, the embedding and the final norm",
            _all(
                _source_has("sglang.srt.models.llama.LlamaDecoderLayer", "self.self_attn",
                            "self.mlp", "self.input_layernorm", "self.post_attention_layernorm"),
                _source_has("sglang.srt.models.llama.LlamaMLP", "self.gate_up_proj",
                            "self.down_proj"),
                _source_has("sglang.srt.models.llama.LlamaModel", "self.embed_tokens",
                            "self.layers", "self.norm"),
                _source_has("sglang.srt.models.llama.LlamaForCausalLM", "self.model",
                            "self.lm_head", "self.config"))),
    ReachIn("RotaryEmbedding.cos_sin_cache / is_neox_style, RMSNorm.variance_epsilon",
            "blending re-rotates cached keys with the served model's own table",
            _all(
                _source_has("sglang.srt.layers.rotary_embedding.base.RotaryEmbedding",
                            "self.cos_sin_cache", "self.is_neox_style"),
                _source_has("sglang.srt.layers.layernorm.RMSNorm",
                            "self.variance_epsilon"))),
    ReachIn("linear layers register their parameter as `weight`",
            "blending reads the served model's weight tensors (no copies)",
            _source_has("sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod",
                        'register_parameter("weight"')),
    ReachIn("Scheduler.tp_worker.model_runner.model / .token_to_kv_pool",
            "blending finds the served model and its KV pool after the scheduler is built",
            _all(
                _source_has(SCHEDULER, "self.tp_worker"),
                _has("sglang.srt.managers.tp_worker.TpModelWorker", "model_runner"),
                _source_has("sglang.srt.model_executor.model_runner.ModelRunner",
                            "self.model =", "self.token_to_kv_pool ="))),
    ReachIn("RadixKey(token_ids, extra_key, cache_salt=)",
            "re-keying the loaded prefix the way SGLang keyed the request",
            _params("sglang.srt.mem_cache.radix_cache.RadixKey.__init__", "extra_key",
                    "cache_salt")),
    ReachIn("Req.full_untruncated_fill_ids / multimodal_inputs / cache_salt / extra_key",
            "the tokens a finished request stores; multimodal requests bypass kvtier",
            _source_has("sglang.srt.managers.schedule_batch.Req.__init__",
                        "self.full_untruncated_fill_ids", "self.multimodal_inputs",
                        "self.cache_salt", "self.extra_key")),
    ReachIn("Req.skip_radix_cache_insert, read by checkpoint_kv_cache and release_kv_cache",
            "a request kept off blended KV stays out of the tree",
            _source_has("sglang.srt.mem_cache.common", "not req.skip_radix_cache_insert",
                        "checkpoint and not req.skip_radix_cache_insert")),
    ReachIn("ScheduleBatch.prepare_for_extend counts `pre_len - req.already_computed` as "
            "cached and sets the breakdown once (`_cache_breakdown_computed`)",
            "a blended request's cached_tokens count only what came from the cache",
            _source_has("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend",
                        "pre_len - req.already_computed",
                        "if not req._cache_breakdown_computed:")),
    ReachIn("TokenizerManager.generate_request / abort_request; a ValueError a request raises "
            "ends SGLang's stream with an error event",
            "a stop ends each request still running with an error and aborts it in the "
            "scheduler (http_stop.py)",
            _all(_has("sglang.srt.managers.tokenizer_manager.TokenizerManager",
                      "generate_request", "abort_request"),
                 _source_has("sglang.srt.entrypoints.http_server", "except ValueError as e:",
                             '"error": {', 'yield b"data: [DONE]'))),
    ReachIn("MHATokenToKVPool.k_buffer / v_buffer, MLATokenToKVPool.kv_buffer",
            "the connectors copy straight from SGLang's per-layer pool tensors",
            _source_has("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
                        "self.k_buffer", "self.v_buffer")),
    ReachIn("http_server._global_state.tokenizer_manager.attach_hicache_storage_communicator",
            "GET/POST /kvtier/tiers reach every TP rank's scheduler through the HiCache "
            "attach channel",
            _source_has("sglang.srt.managers.tokenizer_control_mixin",
                        "attach_hicache_storage_communicator")),
    ReachIn("utils.auth AuthLevel.ADMIN_FORCE / ADMIN_OPTIONAL",
            "the admin routes refuse callers without --admin-api-key",
            _has("sglang.srt.utils.auth.AuthLevel", "ADMIN_FORCE", "ADMIN_OPTIONAL")),
)


def _exists(obj: object, name: str) -> bool:
    """Whether `name` is an attribute, method, submodule, field or keyword parameter of `obj` (a
    module, a class, a function), or an instance attribute: `self.name` in the source of the
    class or a base (assigned there, or set with `setattr` and read there)."""
    if hasattr(obj, name):
        return True
    if inspect.ismodule(obj):  # a submodule not imported yet
        return importlib.util.find_spec(f"{obj.__name__}.{name}") is not None
    if inspect.isclass(obj):
        for cls in obj.__mro__:
            if name in getattr(cls, "__dataclass_fields__", {}) \
                    or name in getattr(cls, "__struct_fields__", ()) \
                    or name in vars(cls).get("__annotations__", {}):
                return True
            try:
                source = inspect.getsource(cls)
            except (OSError, TypeError):
                continue
            # assigned, or read as its own by SGLang's code (attributes set with setattr)
            if re.search(rf"\bself\.{re.escape(name)}\b", source):
                return True
    if callable(obj):
        try:
            return name in inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return False
    return False


def _members(path: str, *names: str) -> Callable[[], None]:
    def check() -> None:
        obj = _resolve(path)
        missing = [n for n in names if not _exists(obj, n)]
        assert not missing, f"{path} has no {missing}"
    return check


# One canary item per owner in SURFACE: everything kvtier's code touches is still there.
REACH_INS += tuple(ReachIn(f"SURFACE {owner}", "listed in sglang_api.SURFACE: " + ", ".join(names),
                           _members(owner, *names)) for owner, names in SURFACE.items())


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
