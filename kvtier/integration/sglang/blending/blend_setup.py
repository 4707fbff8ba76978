"""The blender of one SGLang scheduler (`enable_blending`), or a `ConfigError` naming why this
server cannot blend: data parallel above 1, MLA, models other than Llama-family decoders with
linear RoPE, packed or quantized weights, a KV pool of another dtype; above tensor parallel 1,
a recompute outside SGLang's forward or other than one check layer (`blend_ranks`)."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.config.schema import BlendSection
from kvtier.engine.segments import SegmentStore
from kvtier.errors import ConfigError
from kvtier.integration.sglang.blending import in_forward
from kvtier.integration.sglang.blending.blend_model import separator_ids, served_weights
from kvtier.integration.sglang.blending.blend_ranks import Ranks, Reduce, gather_weights
from kvtier.integration.sglang.blending.blender import SGLangBlender
from kvtier.integration.sglang.blending.rows_forward import RowsForward
from kvtier.integration.sglang.boundary.sglang_views import Opaque
from kvtier.metrics import Counters

__all__ = ["blender_for"]


def blender_for(scheduler: Opaque, store: SegmentStore, section: BlendSection, page_size: int,
                counters: Counters, prefill_s: Callable[[int, int], float] | None = None,
                group: tuple[int, Reduce] | None = None) -> SGLangBlender:
    """The blender over `scheduler`'s served model. `group`: this rank and the TP group's
    all-reduce (needed above tensor parallel 1, where every rank calls this in step: the
    weights are gathered here)."""
    args = scheduler.server_args
    tp = int(getattr(args, "tp_size", 1))
    if int(getattr(args, "dp_size", 1)) > 1:
        raise ConfigError("enable_blending: blending runs at data parallel 1 only (each "
                          "replica would blend apart); drop --dp or enable_blending")
    runner = scheduler.tp_worker.model_runner
    folds = section.in_forward and in_forward.runs_in(runner)
    if tp > 1:
        _check_tp(section, tp, folds, group)
    weights = served_weights(runner.model)
    pool = runner.token_to_kv_pool
    k, v = list(pool.k_buffer), list(pool.v_buffer)
    if k[0].dtype != weights.embed.dtype:
        raise ConfigError(f"enable_blending: the KV pool holds {k[0].dtype} and the model "
                          f"computes in {weights.embed.dtype}; blending needs one dtype "
                          "(drop --kv-cache-dtype)")
    if getattr(scheduler, "tokenizer", None) is None:
        raise ConfigError("enable_blending: the server has no tokenizer to find "
                          "blend_special_str with (--skip-tokenizer-init)")
    separator = separator_ids(scheduler.tokenizer, section.separator)
    ranks = None
    if tp > 1:
        assert group is not None
        ranks = Ranks(group[0], tp, group[1])
        weights = gather_weights(weights, ranks, int(runner.model.config.vocab_size))
    # At TP 1 the rows past the check layers run through SGLang's model in the blend's job,
    # before admission (no stream waits for them); above, collectives keep them in the extend.
    rows = RowsForward(runner) if folds and tp == 1 else None
    return SGLangBlender(weights, store, section, separator, (k, v), page_size, counters,
                         prefill_s, in_forward=folds, ranks=ranks, rows=rows)


def _check_tp(section: BlendSection, tp: int, folds: bool,
              group: tuple[int, Reduce] | None) -> None:
    """What blending at tensor parallel `tp` needs (`blend_ranks`), refused by name."""
    if not folds:
        raise ConfigError(f"enable_blending at tensor parallel {tp}: the recompute must run in "
                          "SGLang's forward (blend_in_forward: true, on SGLang's CPU engine "
                          "with cpu_prefix_attention: true); drop --tp or enable_blending")
    if len(section.check_layers) != 1 or section.check_layers[0] < 0:
        raise ConfigError(f"blend_check_layers: {list(section.check_layers)}: at tensor "
                          f"parallel {tp} blending takes one check layer, from 0")
    if group is None:
        raise ConfigError(f"enable_blending at tensor parallel {tp}: no TP group to agree on")
