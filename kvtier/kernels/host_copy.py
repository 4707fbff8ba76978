"""The copy kernel between a CUDA KV pool and chunks: pinned host chunks, or a staging buffer.

On a GPU, kvtier's memory objects stay in the pinned host arena. `gather_host` copies pool rows
into chunks and `scatter_host` the reverse: one kernel launch for all the chunks of a call,
enqueued on the caller's current CUDA stream. Chunks in pinned host memory are read or written
directly over PCIe (mapped, UVA: `KVTIER_GPU_COPY=mapped`); chunks on the pool's device are the
staged path's buffers (`staging`, the default), which the copy engines move to the arena.
Nothing here synchronises with the GPU: slot values are checked by the kernel, which leaves a
row with a bad slot alone and sets its chunk's word in `status` (a pinned int32 tensor, one word
per chunk, written on the stream after the copy; 0 = copied whole). Read `status` only once an
event recorded after the call has completed.

Without the CUDA kernel (a CUDA torch, but no CUDA toolkit when the kernels were built) the
PyTorch reference does the same through a GPU staging buffer, still without a sync. The grid is
bounded (`KVTIER_CUDA_COPY_BLOCKS`, default 32 blocks of 256 threads) so that the forward pass
keeps the other SMs while a copy runs: measured on an H200, 8 blocks already move 0.93x of the
PCIe limit, and a grid that fills the GPU makes a concurrent forward wait for the whole copy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError
from kvtier.kernels import checks
from kvtier.kernels.extension import check_result, kernel
from kvtier.kernels.reference import copyable, reference_gather

__all__ = ["gather_host", "scatter_host", "STATUS_SKIP", "STATUS_BAD", "copy_blocks",
           "reference_gather_host", "reference_scatter_host"]

STATUS_SKIP = 1  # a gather met a -1 slot: the chunk is incomplete
STATUS_BAD = 2  # a slot outside [-1, num_slots): its rows were not copied
DEFAULT_BLOCKS = 32


def copy_blocks() -> int:
    """The copy kernel's grid size: `KVTIER_CUDA_COPY_BLOCKS` (a positive int) or 32."""
    raw = os.environ.get("KVTIER_CUDA_COPY_BLOCKS", "")
    if not raw:
        return DEFAULT_BLOCKS
    try:
        blocks = int(raw)
    except ValueError:
        blocks = 0
    if blocks <= 0:
        raise ConfigError(f"environment KVTIER_CUDA_COPY_BLOCKS must be a positive int, got "
                          f"{raw!r}")
    return blocks


def gather_host(layers: Sequence[torch.Tensor], slots: torch.Tensor,
                outs: Sequence[torch.Tensor], status: torch.Tensor) -> None:
    """`outs[c][l, t] = layers[l][slots[o_c + t]]` (`o_c`: the tokens of the chunks before c),
    enqueued on the current stream.

    Args:
        layers: N contiguous `[num_slots, hidden]` tensors on one CUDA device.
        slots: 1-D int64 on that device, one pool row per token of all chunks in order.
        outs: contiguous `[N, T_c, hidden]` CPU tensors in pinned memory, of the layers' dtype.
        status: pinned int32 CPU tensor, one word per chunk: `STATUS_SKIP` if the chunk met a
            -1 slot, `STATUS_BAD` if a slot was out of range (those rows are not written).

    Raises:
        ValueError: naming the bad argument; nothing has been enqueued.
    """
    first = _check(layers, slots, outs, status, "outs")
    if (ext := kernel(first.device)) is not None:
        return check_result(ext.gather_host(list(layers), slots, list(outs), status,
                                                copy_blocks()))
    reference_gather_host(layers, slots, outs, status)


def scatter_host(srcs: Sequence[torch.Tensor], slots: torch.Tensor,
                 layers: Sequence[torch.Tensor], status: torch.Tensor) -> None:
    """`layers[l][slots[o_c + t]] = srcs[c][l, t]` for every slot that is not -1, enqueued on
    the current stream; `status` gets `STATUS_BAD` for a chunk with out-of-range slots (those
    rows are not written). Arguments as in `gather_host`; `srcs` stay untouched, and must
    stay allocated until the copy has run.

    Raises:
        ValueError: naming the bad argument; nothing has been enqueued.
    """
    first = _check(layers, slots, srcs, status, "srcs")
    if (ext := kernel(first.device)) is not None:
        return check_result(ext.scatter_host(list(srcs), slots, list(layers), status,
                                                 copy_blocks()))
    reference_scatter_host(srcs, slots, layers, status)


def reference_gather_host(layers: Sequence[torch.Tensor], slots: torch.Tensor,
                          outs: Sequence[torch.Tensor], status: torch.Tensor) -> None:
    """The PyTorch reference of `gather_host` (no argument checks), through a staging buffer
    on the layers' device; sync-free, so it also runs on CPU tensors."""
    n = layers[0].shape[0]
    words = []
    start = 0
    for out in outs:
        rows = slots[start:start + out.shape[1]]
        start += out.shape[1]
        words.append(_status(rows, n, skip_counts=True))
        staged = torch.empty(out.shape, dtype=out.dtype, device=rows.device)
        reference_gather(layers, rows.clamp(0, n - 1), staged)
        out.copy_(staged, non_blocking=True)  # rows of bad slots: dropped with their chunk
    status.copy_(torch.stack(words), non_blocking=True)


def reference_scatter_host(srcs: Sequence[torch.Tensor], slots: torch.Tensor,
                           layers: Sequence[torch.Tensor], status: torch.Tensor) -> None:
    """The PyTorch reference of `scatter_host` (no argument checks); sync-free, so it also
    runs on CPU tensors. Rows to skip are redirected, not compacted (compacting would read
    the mask on the host): each is written with the bytes of the chunk's first kept row, at
    that row's slot, so the duplicate writes agree."""
    n = layers[0].shape[0]
    words = []
    start = 0
    for src in srcs:
        rows = slots[start:start + src.shape[1]]
        start += src.shape[1]
        words.append(_status(rows, n, skip_counts=False))
        keep = (rows >= 0) & (rows < n)
        # Index with 1-element tensors: a 0-d index tensor would be read on the host.
        first = keep.to(torch.int32).argmax().reshape(1)  # 0 when nothing is kept
        kept_any = keep.any()
        target = torch.where(keep, rows, rows.index_select(0, first)).clamp(0, n - 1)
        staged = src.to(rows.device, non_blocking=True)
        for layer, new in zip(layers, staged, strict=True):
            dst, new = copyable(layer), copyable(new)
            # Nothing kept: every write lands on row 0 with its own current bytes.
            fill = torch.where(kept_any, new.index_select(0, first), dst[:1])
            dst.index_copy_(0, target, torch.where(keep[:, None], new, fill))
    status.copy_(torch.stack(words), non_blocking=True)


def _status(rows: torch.Tensor, n: int, *, skip_counts: bool) -> torch.Tensor:
    """A chunk's status word as a 0-d int32 tensor on the rows' device (no sync)."""
    bad = ((rows < checks.SKIP_SLOT) | (rows >= n)).any().to(torch.int32) * STATUS_BAD
    if not skip_counts:
        return bad
    return bad | (rows == checks.SKIP_SLOT).any().to(torch.int32) * STATUS_SKIP


def _check(layers: Sequence[torch.Tensor], slots: torch.Tensor,
           chunks: Sequence[torch.Tensor], status: torch.Tensor, name: str) -> torch.Tensor:
    first = checks.check_layers(layers)
    if first.device.type != "cuda":
        raise ValueError(f"layers must be on a CUDA device, got {first.device}")
    checks.check_slots(slots, first, allow_skip=True, check_range=False)
    if isinstance(chunks, torch.Tensor) or not chunks:
        raise ValueError(f"{name} must be a non-empty sequence of [layers, tokens, hidden] "
                         f"tensors")
    want = (len(layers), first.shape[1])
    total = 0
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.Tensor) or chunk.dim() != 3 or \
                (chunk.shape[0], chunk.shape[2]) != want:
            raise ValueError(f"{name}[{i}] must be a [{want[0]}, tokens, {want[1]}] tensor, "
                             f"got {checks.describe(chunk)}")
        # A chunk on the pool's device is a staging buffer (`staging`); an empty one is never read.
        staged = chunk.device == first.device
        pinned = staged or chunk.numel() == 0 or chunk.is_pinned()
        if chunk.dtype != first.dtype or not (staged or chunk.device.type == "cpu") or \
                not chunk.is_contiguous() or not pinned:
            raise ValueError(f"{name}[{i}] must be a contiguous {first.dtype} tensor in pinned "
                             f"host memory (or on {first.device}), got {chunk.dtype} on "
                             f"{chunk.device}{'' if pinned else ' (not pinned)'}")
        total += chunk.shape[1]
    if total != slots.numel():
        raise ValueError(f"{name} hold {total} tokens, slots has {slots.numel()}")
    if status.dtype != torch.int32 or status.device.type != "cpu" or \
            status.shape != (len(chunks),) or not status.is_pinned():
        raise ValueError(f"status must be a pinned int32 CPU tensor of shape ({len(chunks)},), "
                         f"got {checks.describe(status)} on {status.device}")
    return first
