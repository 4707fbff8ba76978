"""The SGLang plugin (entry point `sglang.srt.plugins: kvtier`), loaded in every SGLang process.

`register` registers the `kvtier` radix-cache backend (`build_radix_cache`: one per TP rank's
scheduler, SGLang's unified tree plus a kvtier engine) and installs kvtier's hooks: two flags
on SGLang's own argument parser and the launch checks behind them (`flags`: `python -m
sglang.launch_server` and `sglang serve` load plugins before they parse), the scheduler's
prefetch gate and batch boundaries (`scheduler_hooks`), tier attach/detach
(`admin.ops`) and a bounded stop (`stop.shutdown`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integration.sglang.boundary.sglang_api import HOOK_TARGETS, all_reduce
from kvtier.integration.sglang.boundary.sglang_views import TreeCacheBuildContextView
from kvtier.integration.sglang.launch.flags import (
    BACKEND_NAME,
    around_add_cli_args,
    around_from_cli_args,
    check_launch,
)
from kvtier.integration.sglang.launch.scheduler_hooks import (
    after_scheduler_init,
    before_batch_result,
    before_idle,
    before_run_batch,
)

if TYPE_CHECKING:
    import torch

    from kvtier.integration.sglang.rank.radix_cache import KVTierRadixCache

__all__ = ["register", "BACKEND_NAME", "build_radix_cache"]

logger = logging.getLogger(__name__)

# The hooks' names here before they moved (issue 73), for callers that import them from here.
_add_cli_args, _from_cli_args = around_add_cli_args, around_from_cli_args
_check_launch = check_launch
_enable_prefetch_hooks, _on_idle = after_scheduler_init, before_idle
_run_batch, _batch_result = before_run_batch, before_batch_result


def register() -> None:
    """Entry point: register the radix-cache backend and the CLI flags. Idempotent."""
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, build_radix_cache)
    # Tier attach/detach at run time, each rank's side: kvtier/integration/sglang/admin/ops.py.
    from kvtier.integration.sglang.admin import ops as admin
    from kvtier.integration.sglang.launch import cpu_attention
    from kvtier.integration.sglang.stop import shutdown

    hooks = ((HOOK_TARGETS["add_cli_args"], around_add_cli_args, HookType.AROUND),
             (HOOK_TARGETS["from_cli_args"], around_from_cli_args, HookType.AROUND),
             (HOOK_TARGETS["scheduler_init"], after_scheduler_init, HookType.AFTER),
             (HOOK_TARGETS["process_batch_result"], before_batch_result, HookType.BEFORE),
             (HOOK_TARGETS["run_batch"], before_run_batch, HookType.BEFORE),
             (HOOK_TARGETS["on_idle"], before_idle, HookType.BEFORE),
             (HOOK_TARGETS["attach"], admin.wrap_attach, HookType.AROUND),
             (HOOK_TARGETS["detach"], admin.wrap_detach, HookType.AROUND),
             (HOOK_TARGETS["launch_server"], shutdown.around_launch_server, HookType.AROUND))
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)
    cpu_attention.install_if_asked()
    shutdown.set_up_server_child()


def build_radix_cache(ctx: TreeCacheBuildContextView) -> KVTierRadixCache:
    """The `kvtier` radix-cache factory: SGLang's unified tree plus a kvtier engine."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from kvtier.connectors import hugepages
    from kvtier.engine import CacheEngine
    from kvtier.integration.sglang.launch.identity import (
        model_config,
        model_identity,
        served_model_name,
    )
    from kvtier.integration.sglang.rank.adapter import (
        SGLangKVTier,
        build_connector,
        check_page_size,
    )
    from kvtier.integration.sglang.rank.radix_cache import KVTierRadixCache

    unsupported = [name for name in ("is_hybrid_swa", "is_hybrid_ssm", "is_dsa",
                                     "enable_hierarchical_cache", "disable_radix_cache")
                   if getattr(ctx, name, False)]
    if unsupported:
        raise ConfigError(f"kvtier does not support this configuration ({', '.join(unsupported)})")
    params = ctx.params
    if getattr(params, "pp_size", 1) > 1:
        raise ConfigError("kvtier does not support pipeline parallelism (pp_size > 1)")
    config = load_config()
    page_size = int(params.page_size)
    check_page_size(config, page_size)
    connector = build_connector(params.token_to_kv_pool_allocator.get_kvcache())
    if config.huge_pages and connector.device.type == "cpu":
        # Random-row copies on a CPU pool were 1.3-2.2x faster on huge pages; once, at launch.
        logger.info("kvtier: KV pool: %s", hugepages.back(connector.pool_layers,
                                                         collapse=True).describe())
    server_args = ctx.server_args
    name = served_model_name(server_args)
    model = model_identity(server_args, config.model_fingerprint)
    engine = CacheEngine(config, model_name=model, layout=connector.layout,
                         connector=connector, world_size=int(ctx.tp_size),
                         rank=int(ctx.tp_rank), page_size=page_size)
    try:
        engine.prefill.plan_from(model_config(server_args))
        cache: KVTierRadixCache = create_unified_radix_cache(ctx, cache_class=KVTierRadixCache)

        def reduce_min(t: torch.Tensor) -> None:
            import torch.distributed as dist

            all_reduce(cache, t, dist.ReduceOp.MIN)

        # MLA: every rank stores into its own CPU tier, rank 0 alone writes down (engine.py)
        kvtier = SGLangKVTier(engine, page_size, reduce_min if ctx.tp_size > 1 else None,
                              rank=int(ctx.tp_rank))
    except BaseException:
        engine.close()
        raise
    cache.attach_kvtier(kvtier)
    if params.enable_kv_cache_events and config.tier_events:  # kvtier's tiers publish too
        from kvtier.integration.sglang.rank.tier_events import TierEvents

        cache.publish_tier_events(TierEvents(
            page_size, kvtier.counters, starts_prefix=engine.keys.starts_prefix,
            dynamo_format=params.dynamo_kv_event_format,
            lora_names=params.kv_event_lora_names))
    from kvtier.integration.sglang.stop import shutdown

    if shutdown.in_server():
        shutdown.install_scheduler_handlers(kvtier)
    logger.info("kvtier enabled: model %s, layout %s, page size %d, chunk size %d, tiers %s, "
                "TP rank %d of %d", name, connector.layout.fingerprint(config.chunk_size),
                page_size, config.chunk_size, list(config.tiers), ctx.tp_rank, ctx.tp_size)
    return cache
