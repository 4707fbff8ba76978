"""The plugin's hooks on SGLang's scheduler, installed by `plugin.register` in every process.

After `Scheduler.__init__` (`after_scheduler_init`): SGLang's scheduler calls the prefix
cache's storage-prefetch hooks (`prefetch_from_storage`, `check_prefetch_progress`, ...) only
when its `enable_lmcache` or HiCache-storage flag is on, so once a scheduler is built with the
kvtier tree its own `enable_lmcache` attribute is turned on (the server args stay untouched,
so SGLang never builds or imports LMCache; kvtier's tree implements every call the flag
gates); blending is set up over the loaded model if the config asks for it.

Around each batch (`before_run_batch`, `before_batch_result`, `before_idle`): whether the
engine computes (`background.ENGINE`, which the lower-tier writers yield to on a CPU engine,
and a stop's drain waits for), and how fast this server prefills (the adaptive prefetch
policy's yardstick).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, cast

from kvtier.background import BUSY_SHARE, ENGINE, HOLD_S
from kvtier.errors import ConfigError
from kvtier.integration.sglang.boundary.sglang_api import all_reduce, enable_storage_prefetch
from kvtier.integration.sglang.boundary.sglang_views import (
    Opaque,
    ScheduleBatchView,
    SchedulerView,
)
from kvtier.integration.sglang.stop.shutdown import note_batch

if TYPE_CHECKING:
    import torch

    from kvtier.integration.sglang.rank.adapter import SGLangKVTier
    from kvtier.integration.sglang.rank.radix_cache import KVTierRadixCache

__all__ = ["after_scheduler_init", "before_batch_result", "before_idle", "before_run_batch"]

logger = logging.getLogger(__name__)


def after_scheduler_init(result: Opaque, scheduler: SchedulerView, *args: Opaque,
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
    from kvtier.integration.sglang.blending.blend_setup import blender_for
    from kvtier.integration.sglang.blending.engine_check import EngineSegmentCheck

    config = kvtier.engine.config
    try:
        store = kvtier.engine.segments()
    except ValueError as exc:
        raise ConfigError(f"enable_blending: {exc} (MLA models have no keys to re-rotate); "
                          "drop enable_blending for this model") from None
    cache = cast("KVTierRadixCache", scheduler.tree_cache)

    def reduce(t: torch.Tensor, op: str) -> None:
        import torch.distributed as dist

        all_reduce(cache, t, dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM)

    blender = blender_for(scheduler, store, config.blend, kvtier.page_size, kvtier.counters,
                          kvtier.engine.prefill.recompute_s, (kvtier.rank, reduce))
    # A verified request's first segment, as SGLang computed it, checks that segment's records
    kv_pool = cast("Opaque", scheduler).tp_worker.model_runner.token_to_kv_pool
    by = ("SGLang's model on kvtier's segment thread (rows_forward.py)" if blender.rows
          else "kvtier's forward (kvtier/blend/forward.py)")
    check = EngineSegmentCheck(store, (list(kv_pool.k_buffer), list(kv_pool.v_buffer)),
                               blender.separator, config.blend.min_tokens, kvtier.counters, by)
    kvtier.check_segments(lambda job: check.check(job.token_ids, job.slots, job.salt,
                                                  job.prompt_len, job.ready))
    pool = blender.pool_k[0]
    cache.attach_blender(blender, pool.shape[0], pool.device)
    logger.info("kvtier: blending on: segments end at %r (%d tokens), check layers %s, "
                "recompute shares %s, segments of %d+ tokens; the rows past the check layers "
                "run %s; segments alone are computed by %s", config.blend_special_str,
                len(blender.separator), list(config.blend_check_layers),
                list(config.blend_recompute_ratios), config.blend_min_tokens,
                "in SGLang's model before admission" if blender.rows else
                "in SGLang's extend" if blender.in_forward else "in kvtier's forward", by)


def _device(scheduler: SchedulerView) -> str:
    return str(getattr(getattr(scheduler, "server_args", None), "device", ""))


def before_run_batch(scheduler: SchedulerView, *args: Opaque, **kwargs: Opaque) -> None:
    """Before `Scheduler.run_batch`: a batch starts; the engine is busy until its result is
    handled (`process_batch_result`: with the overlap scheduler the forward may still run
    after `run_batch` returned)."""
    ENGINE.enter()
    note_batch(True)  # a stop's drain waits for it (shutdown.py)


def before_idle(scheduler: SchedulerView, *args: Opaque, **kwargs: Opaque) -> None:
    """Before `Scheduler.on_idle` (a loop turn that ran no batch): whether requests still wait
    (then the engine is about to compute, not quiet)."""
    note_batch(False)
    if ENGINE.enabled:
        ENGINE.idle(_waiting(scheduler))


def _waiting(scheduler: SchedulerView) -> bool:
    return bool(getattr(scheduler, "waiting_queue", None))


def before_batch_result(scheduler: SchedulerView, batch: ScheduleBatchView | None,
                        *args: Opaque, **kwargs: Opaque) -> None:
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
