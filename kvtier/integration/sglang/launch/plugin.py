"""The SGLang plugin (entry point `sglang.srt.plugins: kvtier`), loaded in every SGLang process.

It registers the `kvtier` radix-cache backend and adds two flags to SGLang's own argument
parser (`python -m sglang.launch_server` and `sglang serve` load plugins before they parse):

    --enable-kvtier             selects `--radix-cache-backend kvtier`
    --kvtier-config-file FILE   kvtier's YAML config (else KVTIER_CONFIG_FILE, else
                                LMCACHE_CONFIG_FILE, else defaults)

The config is validated in the launcher, before any worker starts, and reaches the scheduler
processes through `KVTIER_CONFIG_FILE` (they inherit the launcher's environment).

Background loads: SGLang's scheduler calls the prefix cache's storage-prefetch hooks
(`prefetch_from_storage`, `check_prefetch_progress`, ...) only when its `enable_lmcache` or
HiCache-storage flag is on. Once a scheduler is built with the kvtier tree, the plugin turns
that scheduler's own `enable_lmcache` attribute on (the server args stay untouched, so SGLang
never builds or imports LMCache); kvtier's tree implements every call the flag gates.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, cast

from kvtier.background import BUSY_SHARE, ENGINE, HOLD_S
from kvtier.config import Config, load_config
from kvtier.errors import ConfigError
from kvtier.integration.sglang.boundary.sglang_api import (
    HOOK_TARGETS,
    all_reduce,
    enable_storage_prefetch,
)
from kvtier.integration.sglang.boundary.sglang_views import (
    LaunchArgsView,
    Opaque,
    ScheduleBatchView,
    SchedulerView,
    TreeCacheBuildContextView,
)
from kvtier.integration.sglang.stop.shutdown import note_batch

if TYPE_CHECKING:
    import torch

    from kvtier.integration.sglang.boundary.sglang_views import ServerArgsView
    from kvtier.integration.sglang.rank.adapter import SGLangKVTier
    from kvtier.integration.sglang.rank.radix_cache import KVTierRadixCache

__all__ = ["register", "BACKEND_NAME", "build_radix_cache"]

logger = logging.getLogger(__name__)

BACKEND_NAME = "kvtier"


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

    hooks = ((HOOK_TARGETS["add_cli_args"], _add_cli_args, HookType.AROUND),
             (HOOK_TARGETS["from_cli_args"], _from_cli_args, HookType.AROUND),
             (HOOK_TARGETS["scheduler_init"], _enable_prefetch_hooks, HookType.AFTER),
             (HOOK_TARGETS["process_batch_result"], _batch_result, HookType.BEFORE),
             (HOOK_TARGETS["run_batch"], _run_batch, HookType.BEFORE),
             (HOOK_TARGETS["on_idle"], _on_idle, HookType.BEFORE),
             (HOOK_TARGETS["attach"], admin.wrap_attach, HookType.AROUND),
             (HOOK_TARGETS["detach"], admin.wrap_detach, HookType.AROUND),
             (HOOK_TARGETS["launch_server"], shutdown.around_launch_server, HookType.AROUND))
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)
    cpu_attention.install_if_asked()
    shutdown.set_up_server_child()


def _add_cli_args(original: Callable[..., Opaque], parser: argparse.ArgumentParser) -> Opaque:
    out = original(parser)
    group = parser.add_argument_group("kvtier")
    group.add_argument("--enable-kvtier", action="store_true",
                       help="Keep KV in kvtier's CPU/disk/Redis tiers (sets "
                            "--radix-cache-backend kvtier).")
    group.add_argument("--kvtier-config-file", default=None,
                       help="kvtier YAML config; default: $KVTIER_CONFIG_FILE, then "
                            "$LMCACHE_CONFIG_FILE, then built-in defaults.")
    return out


def _from_cli_args(original: Callable[..., Opaque], cls: type, args: LaunchArgsView) -> Opaque:
    _one_line_launch_errors()
    # every server on this install, with kvtier or not (a demo's baseline too)
    logging.getLogger("sglang.srt.entrypoints.http_server").addFilter(_FreezeGcRace())
    enabled = bool(getattr(args, "enable_kvtier", False))
    config_file = getattr(args, "kvtier_config_file", None)
    if config_file and not enabled and args.radix_cache_backend != BACKEND_NAME:
        raise ConfigError("--kvtier-config-file needs --enable-kvtier")
    if enabled:
        if args.radix_cache_backend not in (None, BACKEND_NAME):
            raise ConfigError(f"--enable-kvtier conflicts with --radix-cache-backend "
                              f"{args.radix_cache_backend}")
        args.radix_cache_backend = BACKEND_NAME
    if args.radix_cache_backend == BACKEND_NAME:
        if config_file:
            os.environ["KVTIER_CONFIG_FILE"] = os.path.abspath(config_file)
        config = load_config()
        if getattr(args, "device", None) == "cpu":  # before any worker starts: they inherit it
            from kvtier.integration.sglang.launch.cpu import prepare_cpu_engine

            for change in prepare_cpu_engine(huge_pages=config.huge_pages,
                                             prefix_attention=config.cpu_prefix_attention,
                                             ranks=_worker_ranks(args)):
                logger.info("kvtier: --device cpu: %s", change)
        # Fail in the launcher, with the file and key named, not later in a worker.
        _check_launch(config, args)
        from kvtier.integration.sglang.launch.identity import model_fingerprint

        # reads the weights once, here; the workers read the cache
        model_fingerprint(cast("ServerArgsView", args))
        _add_http_routes()
        _bounded_stop()
    return original(cls, args)


class _FreezeGcRace(logging.Filter):
    """SGLang posts `/freeze_gc` to itself once it is up; under `--skip-server-warmup` that
    request can reach the port before uvicorn binds it, and SGLang logs a 70-line traceback
    for what only means garbage collection was not frozen. Keeps its one line, explained."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.getMessage() == "post-warmup freeze_gc failed":
            record.msg = ("post-warmup freeze_gc failed: the request raced the HTTP server's "
                          "start (--skip-server-warmup); harmless, garbage collection is just "
                          "not frozen (traceback dropped by kvtier)")
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


def _worker_ranks(args: LaunchArgsView) -> int:
    """The scheduler processes SGLang starts, each binding its own cores on a CPU."""
    sizes = (getattr(args, name, 1) for name in ("dp_size", "tp_size", "pp_size"))
    ranks = 1
    for size in sizes:
        ranks *= int(size or 1)
    return ranks


def _bounded_stop() -> None:
    """A signal stops this server within seconds and lets kvtier write what it has queued
    (shutdown.py); the children learn they are a server's from `LAUNCHER_ENV`."""
    from kvtier.integration.sglang.stop import http_stop, shutdown

    shutdown.prepare_launcher(http_stop.install)
    try:
        import uvicorn
    except ImportError:  # SGLang's HTTP server is uvicorn; without it there is nothing to bound
        return
    http_stop.bound_http_grace(uvicorn.Server)


def _one_line_launch_errors() -> None:
    """In the launcher, a kvtier `ConfigError` nobody catches ends the process with one line
    naming the problem (exit status 1), not a traceback through SGLang's argument parsing.
    Other exceptions keep the hook that was there. Idempotent."""
    previous = sys.excepthook
    if getattr(previous, "kvtier", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, ConfigError):
            print(f"kvtier: {exc}", file=sys.stderr)
            return
        previous(kind, exc, tb)

    hook.kvtier = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _add_http_routes() -> None:
    """`/kvtier/tiers` on SGLang's HTTP app (this is the launcher, which serves it)."""
    from sglang.srt.entrypoints import http_server

    from kvtier.integration.sglang.admin import routes as admin

    admin.add_routes(http_server.app)


def _enable_prefetch_hooks(result: Opaque, scheduler: SchedulerView, *args: Opaque,
                           **kwargs: Opaque) -> Opaque:
    """After `Scheduler.__init__`: route the scheduler's prefetch calls to a kvtier tree; on a
    CPU engine, make the lower-tier writers wait while a batch runs (`background.ENGINE`)."""
    kvtier: SGLangKVTier | None = getattr(getattr(scheduler, "tree_cache", None), "kvtier",
                                          None)
    if kvtier is not None and _device(scheduler) == "cpu":
        ENGINE.enabled = True
        logger.info("kvtier: the engine computes on the CPU: while batches run, lower-tier "
                    "writes wait for idle moments (up to %.0fs, or a long backlog), then take at "
                    "most %.0f%% of the writers' time", HOLD_S, BUSY_SHARE * 100)
        from kvtier.integration.sglang.launch import cpu_attention

        if cpu_attention.installed():
            logger.info("kvtier: an extend over a cached prefix computes the new tokens' "
                        "attention only (cpu_prefix_attention; SGLang's torch_native backend "
                        "recomputes the prefix's)")
    if kvtier is not None and kvtier.engine.config.enable_blending:
        _enable_blending(scheduler, kvtier)
    if kvtier is not None:
        enable_storage_prefetch(scheduler)
        logger.info("kvtier: loads from lower tiers run in the background (prefetch policy %s)",
                    kvtier.engine.config.prefetch_policy)
    return result


def _enable_blending(scheduler: SchedulerView, kvtier: SGLangKVTier) -> None:
    """`enable_blending`: a blender over the served model (loaded by now); `ConfigError`
    naming why this server cannot blend."""
    from kvtier.integration.sglang.blending.blender import SGLangBlender

    config = kvtier.engine.config
    try:
        store = kvtier.engine.segments()
    except ValueError as exc:
        raise ConfigError(f"enable_blending: {exc} (MLA models have no keys to re-rotate); "
                          "drop enable_blending for this model") from None
    blender = SGLangBlender.from_scheduler(scheduler, store, config.blend, kvtier.page_size,
                                           kvtier.counters, kvtier.engine.prefill.recompute_s)
    cache = cast("KVTierRadixCache", scheduler.tree_cache)
    pool = blender.pool_k[0]
    cache.attach_blender(blender, pool.shape[0], pool.device)
    logger.info("kvtier: blending on: segments end at %r (%d tokens), check layers %s, "
                "recompute shares %s, segments of %d+ tokens", config.blend_special_str,
                len(blender.separator), list(config.blend_check_layers),
                list(config.blend_recompute_ratios), config.blend_min_tokens)


def _device(scheduler: SchedulerView) -> str:
    return str(getattr(getattr(scheduler, "server_args", None), "device", ""))


def _run_batch(scheduler: SchedulerView, *args: Opaque, **kwargs: Opaque) -> None:
    """Before `Scheduler.run_batch`: a batch starts; the engine is busy until its result is
    handled (`process_batch_result`: with the overlap scheduler the forward may still run
    after `run_batch` returned)."""
    ENGINE.enter()
    note_batch(True)  # a stop's drain waits for it (shutdown.py)


def _on_idle(scheduler: SchedulerView, *args: Opaque, **kwargs: Opaque) -> None:
    """Before `Scheduler.on_idle` (a loop turn that ran no batch): whether requests still wait
    (then the engine is about to compute, not quiet)."""
    note_batch(False)
    if ENGINE.enabled:
        ENGINE.idle(_waiting(scheduler))


def _waiting(scheduler: SchedulerView) -> bool:
    return bool(getattr(scheduler, "waiting_queue", None))


def _batch_result(scheduler: SchedulerView, batch: ScheduleBatchView | None, *args: Opaque,
                  **kwargs: Opaque) -> None:
    """Before `Scheduler.process_batch_result`: the batch's forward is over, so the engine is
    no longer busy with it (`ENGINE`), and an extend batch tells kvtier how fast this server
    prefills (the adaptive prefetch policy's yardstick)."""
    # Its forward is over: quiet from now on, unless another runs or requests wait to.
    ENGINE.leave(waiting=_waiting(scheduler))
    kvtier: SGLangKVTier | None = getattr(getattr(scheduler, "tree_cache", None), "kvtier",
                                          None)
    if kvtier is None or batch is None or not batch.forward_mode.is_extend():
        return
    launched = getattr(batch, "launch_ts", None)
    lens = getattr(batch, "seq_lens_cpu", None)
    if launched is None or lens is None or not batch.extend_num_tokens:
        return
    kvtier.observe_prefill(int(batch.extend_num_tokens), time.monotonic() - launched,
                           int(lens.max()))


def _check_launch(config: Config, args: LaunchArgsView) -> None:
    """Every launch check at once (`preflight`): one `ConfigError` naming the config's source
    and each problem, before any worker starts or anything is written."""
    from kvtier.integration.sglang.launch.preflight import preflight

    source = os.environ.get("KVTIER_CONFIG_FILE") or os.environ.get("LMCACHE_CONFIG_FILE") \
        or "kvtier defaults"
    for flag in ("enable_hierarchical_cache", "disable_radix_cache"):
        if getattr(args, flag, False):
            raise ConfigError(f"--enable-kvtier cannot be combined with "
                              f"--{flag.replace('_', '-')}")
    found = preflight(config, args)
    for note in found.notes:
        logger.warning("kvtier: %s", note)
    if len(found.problems) == 1:
        raise ConfigError(f"{source}: {found.problems[0]}")
    if found.problems:
        listed = "".join(f"\n  {i}. {p}" for i, p in enumerate(found.problems, 1))
        raise ConfigError(f"{source}: {len(found.problems)} problems stop the launch (kvtier "
                          f"check-config FILE lists them too):{listed}")


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
        kvtier = SGLangKVTier(engine, page_size, reduce_min if ctx.tp_size > 1 else None)
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
