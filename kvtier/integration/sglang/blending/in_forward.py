"""A blend's recompute in SGLang's own forward (issue 75), on its CPU engine.

kvtier's blend job (`blend_jobs`) reads the segments, re-rotates them and computes the first
layers up to the check layer, off the scheduler thread; that picks the tokens a blend must
still compute in every later layer (the share whose values deviate most, each segment's first
token, every token no segment gave, the last one). At admission their rows are written into
the request's slots with the rest (`SGLangBlender.fill`), and registered here (`add`). SGLang
then runs the request's extend as usual, with these rows folded in front of it: the same
model code, weights and kernels as any prefill, so there is no second model on the serving path.

The fold follows SGLang's own (`encoder_swa_replay._fold_batch`, which puts replayed rows in
front of an extend): the forward sees a copy of the `ScheduleBatch` whose extend holds each
registered row's token, slot and position, ahead of the tokens SGLang meant to compute. Two
things differ from a contiguous extend, and are set here: the rows' positions
(`around_model_forward`, over `compute_position`'s), and the attention, where a row sees every
token up to its own position, not every token before the extend
(`cpu_attention.extend_over_prefix` asks `query_positions`). The rows' fresh KV lands in their
own slots, as each layer runs, so later rows and the decode read it.

At `--tp 1` the same rows run before admission instead, on the blend job's thread
(`rows_forward`, through `rows_at`): a folded extend is one prefill step every running stream
waits for. Above it the fold stays, as every rank's forward must run in step.

Hooked where kvtier installs its CPU prefix attention (`cpu_attention.install`), in every
SGLang process; with nothing registered the hooks call SGLang's code unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from copy import copy
from typing import NamedTuple

import torch

from kvtier.integration.sglang.boundary.sglang_views import Opaque
from kvtier.metrics import Counters, RateLimitedLog

__all__ = ["TARGETS", "Splice", "add", "around_forward_batch_generation",
           "around_model_forward", "drop", "folding", "install", "query_positions", "rows_at",
           "runs_in"]

logger = logging.getLogger(__name__)

TARGETS = {
    "forward_batch_generation":
        "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
    "model_forward": "sglang.srt.model_executor.model_runner.ModelRunner.forward",
}


class Splice(NamedTuple):
    """A blended request's rows for SGLang to compute: `rows` (int64 positions, sorted, all
    below `end`), in the extend that follows its admission, where SGLang's prefix is `end`
    tokens (the blend's)."""

    end: int
    rows: torch.Tensor
    counters: Counters | None = None  # counts `sglang.blend_fold_mismatches`


class _Fold(NamedTuple):
    positions: torch.Tensor  # every row of the folded extend, in order
    queries: dict[int, torch.Tensor]  # batch index -> its rows' positions (folded ones only)


_installed: list[bool] = []
_pending: dict[str, Splice] = {}
_lock = threading.Lock()
class _Active(threading.local):
    fold: _Fold | None = None  # the fold of the forward running on this thread


_active = _Active()
_warn = RateLimitedLog(logger)


def install() -> None:
    """Register the fold's hooks with SGLang's plugin registry (`cpu_attention.install`,
    once per process, with the attention that reads `query_positions`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGETS["forward_batch_generation"], around_forward_batch_generation,
                          HookType.AROUND)
    HookRegistry.register(TARGETS["model_forward"], around_model_forward, HookType.AROUND)
    _installed.append(True)


def runs_in(model_runner: Opaque) -> bool:
    """Whether blends on `model_runner` recompute in its forward: its attention is SGLang's
    torch_native backend (the CPU engine's) and this process installed the hooks
    (`cpu_attention`, key `cpu_prefix_attention`). Elsewhere kvtier's forward computes every
    layer, as before: SGLang's GPU attention kernels take no per-row positions here."""
    backend = type(model_runner.attn_backend).__name__
    return bool(_installed) and backend == "TorchNativeAttnBackend"


def add(rid: str, splice: Splice) -> None:
    """Fold `splice` into request `rid`'s next extend (scheduler thread, at admission)."""
    with _lock:
        _pending[rid] = splice


def drop(rid: str | None = None) -> None:
    """Forget request `rid`'s splice (every one when None): it went away unrun."""
    with _lock:
        if rid is None:
            _pending.clear()
        else:
            _pending.pop(rid, None)


@contextmanager
def rows_at(rows: torch.Tensor) -> Iterator[None]:
    """Within: a forward on this thread computes one request's `rows` (its whole extend) at
    their own positions (`rows_forward`: a blend's rows before its admission)."""
    _active.fold = _Fold(rows, {0: rows})
    try:
        yield
    finally:
        _active.fold = None


def folding() -> bool:
    """Whether a forward on this thread runs a folded extend."""
    return _active.fold is not None


def query_positions(index: int) -> torch.Tensor | None:
    """In a forward on this thread, the positions of batch entry `index`'s rows when a splice
    was folded into them (each row attends to the keys up to its own position); else None."""
    fold = _active.fold
    return None if fold is None else fold.queries.get(index)


def around_forward_batch_generation(original: Callable[..., Opaque], self: Opaque,
                                    batch: Opaque = None, *args: object,
                                    **kwargs: object) -> Opaque:
    """AROUND `TpModelWorker.forward_batch_generation`: an extend with registered splices
    runs folded (`_fold`); everything else as SGLang runs it."""
    if batch is None or not _pending or not batch.forward_mode.is_extend_without_speculative():
        return original(self, batch, *args, **kwargs)
    folded = _fold(batch, self.model_runner.req_to_token_pool.req_to_token)
    if folded is None:
        return original(self, batch, *args, **kwargs)
    _active.fold = folded[1]
    try:
        return original(self, folded[0], *args, **kwargs)
    finally:
        _active.fold = None


def around_model_forward(original: Callable[..., Opaque], self: Opaque, forward_batch: Opaque,
                         *args: object, **kwargs: object) -> Opaque:
    """AROUND `ModelRunner.forward`: a folded extend's rows at their own positions
    (SGLang's `compute_position` numbers an extend's rows from its prefix on)."""
    fold = _active.fold
    if fold is not None and forward_batch.forward_mode.is_extend():
        have = forward_batch.positions
        forward_batch.positions = fold.positions.to(have.device, have.dtype)
    return original(self, forward_batch, *args, **kwargs)


def _take(reqs: list[Opaque], prefix_lens: list[int]) -> dict[int, Splice]:
    """The registered splices of `reqs`, by batch index, each removed (it runs once). One whose
    request's prefix is not the blend's end is dropped, loudly: its rows would not be where
    SGLang's extend starts (never expected: the extend follows the admission that wrote them)."""
    found: dict[int, Splice] = {}
    with _lock:
        for i, req in enumerate(reqs):
            splice = _pending.pop(req.rid, None)
            if splice is None:
                continue
            if prefix_lens[i] != splice.end or not len(splice.rows):
                if splice.counters is not None:
                    splice.counters.inc("sglang.blend_fold_mismatches")
                _warn.warning("mismatch", "kvtier: %s's extend starts at %d, its blend ended at "
                              "%d: %d blended rows were not computed by SGLang", req.rid,
                              prefix_lens[i], splice.end, len(splice.rows))
                continue
            found[i] = splice
    return found


def _fold(batch: Opaque, req_to_token: torch.Tensor) -> tuple[Opaque, _Fold] | None:
    """A copy of `batch` whose spliced requests compute their rows ahead of their extend (as
    SGLang's replay fold does), and the rows' positions; None when no request of it has one."""
    prefix_lens, extend_lens = list(batch.prefix_lens), list(batch.extend_lens)
    splices = _take(list(batch.reqs), prefix_lens)
    if not splices:
        return None
    pools = batch.req_pool_indices_cpu.tolist()
    ids, locs, cpu_ids, positions = [], [], [], []
    queries: dict[int, torch.Tensor] = {}
    off = 0
    for i, req in enumerate(batch.reqs):
        prefix, n = prefix_lens[i], extend_lens[i]
        own = torch.arange(prefix, prefix + n, dtype=torch.int64)
        splice = splices.get(i)
        if splice is not None:
            rows = splice.rows.to(torch.int64)
            fill = req.full_untruncated_fill_ids
            head = torch.tensor([fill[r] for r in rows.tolist()], dtype=torch.int64)
            ids.append(head.to(batch.input_ids.device, batch.input_ids.dtype))
            cpu_ids.append(head)
            locs.append(req_to_token[pools[i]][rows.to(req_to_token.device)]
                        .to(batch.out_cache_loc.device, batch.out_cache_loc.dtype))
            own = torch.cat([rows, own])
            queries[i] = own
            prefix_lens[i] -= len(rows)
            extend_lens[i] += len(rows)
        positions.append(own)
        ids.append(batch.input_ids[off:off + n])
        locs.append(batch.out_cache_loc[off:off + n])
        if batch.prefill_input_ids_cpu is not None:
            cpu_ids.append(batch.prefill_input_ids_cpu[off:off + n].to(torch.int64))
        off += n
    folded = copy(batch)
    folded.input_ids = torch.cat(ids)
    folded.out_cache_loc = torch.cat(locs)
    if batch.prefill_input_ids_cpu is not None:
        folded.prefill_input_ids_cpu = torch.cat(cpu_ids).to(batch.prefill_input_ids_cpu.dtype)
    folded.prefix_lens, folded.extend_lens = prefix_lens, extend_lens
    folded.extend_num_tokens = sum(extend_lens)
    if batch.extend_logprob_start_lens is not None:  # the rows give no input logprobs
        folded.extend_logprob_start_lens = [
            start + (len(splices[i].rows) if i in splices else 0)
            for i, start in enumerate(batch.extend_logprob_start_lens)]
    return folded, _Fold(torch.cat(positions), queries)
