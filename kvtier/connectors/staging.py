"""The staged copy between a CUDA pool and chunks in the pinned arena: the GPU path's default.

A kernel that writes pinned host memory straight over PCIe (`host_copy`, "mapped") reached
0.88-0.91x of a pinned memcpy on an H100 (49-50 GB/s against 55), and it holds its SMs for the
whole transfer. The copy engines reach the PCIe limit but move contiguous bytes only. So a store
runs the same kernel into a staging buffer on the GPU (device memory: a fraction of the
transfer's time), and a copy engine moves that buffer into the chunks while the kernel fills the
next buffer; a load runs the pipeline the other way. Two buffers of about `STAGE_BYTES` each
(a group holds whole chunks, at least one) come from PyTorch's caching allocator per call.

Streams: the kernels run on the caller's current stream (kvtier's store or load stream), the
memcpys on this object's own copy streams, one per direction, ordered by events in between.
Nothing here waits on the host; the caller's current stream has run every copy once it reaches
the work enqueued after the call. Status words and slot checks are `host_copy`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError
from kvtier.kernels import host_copy

__all__ = ["Staging", "STAGE_BYTES", "copy_path", "groups", "contiguous_runs"]

STAGE_BYTES = 32 << 20  # a group's target size: large enough for a memcpy at full speed


def copy_path() -> str:
    """`KVTIER_GPU_COPY`: `staged` (the default) or `mapped` (the kernel alone, no GPU memory
    beyond the pool; for a GPU without room for two staging buffers)."""
    raw = os.environ.get("KVTIER_GPU_COPY", "") or "staged"
    if raw not in ("staged", "mapped"):
        raise ConfigError(f"environment KVTIER_GPU_COPY must be 'staged' or 'mapped', got "
                          f"{raw!r}")
    return raw


def groups(sizes: Sequence[int], target: int = STAGE_BYTES) -> list[range]:
    """Consecutive chunks (their byte sizes) in groups of at most `target` bytes, or of one
    chunk where a chunk alone is larger."""
    out: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > target:
            out.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def contiguous_runs(tensors: Sequence[torch.Tensor]) -> list[range]:
    """Consecutive tensors whose bytes follow each other in memory (one memcpy each run)."""
    out: list[range] = []
    start = 0
    for i in range(1, len(tensors) + 1):
        if i == len(tensors) or tensors[i].data_ptr() != \
                tensors[i - 1].data_ptr() + tensors[i - 1].nbytes:
            out.append(range(start, i))
            start = i
    return out


def _span(tensors: Sequence[torch.Tensor], run: range) -> torch.Tensor:
    """One flat view over `tensors[run]` (contiguous in one storage, per `contiguous_runs`)."""
    first = tensors[run.start]
    return first.as_strided((sum(tensors[i].numel() for i in run),), (1,))


def _copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """dst[i] <- src[i] on the current stream, one memcpy per run contiguous on both sides."""
    for a in contiguous_runs(dst):
        for run in contiguous_runs([src[i] for i in a]):
            part = range(a.start + run.start, a.start + run.stop)
            _span(dst, part).copy_(_span(src, part), non_blocking=True)


class Staging:
    """The staged pipeline for one CUDA device: its two copy streams. Thread-safe.

    Args:
        device: the pool's CUDA device.
        stage_bytes: a group's target size (tests make it small to turn the ring).
    """

    def __init__(self, device: torch.device, stage_bytes: int = STAGE_BYTES):
        self.device = device
        self.stage_bytes = stage_bytes
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def gather(self, layers: Sequence[torch.Tensor], slots: torch.Tensor,
               hosts: Sequence[torch.Tensor], status: torch.Tensor) -> None:
        """`host_copy.gather_host(layers, slots, hosts, status)` through staging buffers,
        enqueued: the current stream waits for the last memcpy."""
        if not hosts:
            return
        stream = torch.cuda.current_stream(self.device)
        firsts = _firsts(hosts)
        parts = groups([h.nbytes for h in hosts], self.stage_bytes)
        ring = self._ring(layers[0].dtype, hosts, parts)  # the kernel writes first: stream's
        freed: list[torch.cuda.Event | None] = [None, None]
        for g, part in enumerate(parts):
            buf, last = ring[g % 2], freed[g % 2]
            if last is not None:
                stream.wait_event(last)  # the memcpy two groups back has read this buffer
            views = _views(buf, [hosts[c] for c in part])
            host_copy.gather_host(layers, slots[firsts[part.start]:firsts[part.stop]], views,
                                  status[part.start:part.stop])
            filled = torch.cuda.Event()
            filled.record(stream)
            self.d2h.wait_event(filled)
            with torch.cuda.stream(self.d2h):
                _copy([hosts[c] for c in part], views)
                freed[g % 2] = done = torch.cuda.Event()
                done.record(self.d2h)
        for buf in ring:
            buf.record_stream(self.d2h)
        stream.wait_stream(self.d2h)

    def scatter(self, hosts: Sequence[torch.Tensor], slots: torch.Tensor,
                layers: Sequence[torch.Tensor], status: torch.Tensor) -> None:
        """`host_copy.scatter_host(hosts, slots, layers, status)` through staging buffers,
        enqueued on the current stream (which runs the kernels). `hosts` must stay allocated
        until the current stream has run what this enqueued."""
        if not hosts:
            return
        stream = torch.cuda.current_stream(self.device)
        firsts = _firsts(hosts)
        parts = groups([h.nbytes for h in hosts], self.stage_bytes)
        with torch.cuda.stream(self.h2d):  # the memcpy writes first: the buffers are h2d's
            ring = self._ring(layers[0].dtype, hosts, parts)
        freed: list[torch.cuda.Event | None] = [None, None]
        for g, part in enumerate(parts):
            buf, last = ring[g % 2], freed[g % 2]
            views = _views(buf, [hosts[c] for c in part])
            with torch.cuda.stream(self.h2d):
                if last is not None:
                    self.h2d.wait_event(last)  # the kernel two groups back has read it
                _copy(views, [hosts[c] for c in part])
                filled = torch.cuda.Event()
                filled.record(self.h2d)
            stream.wait_event(filled)
            host_copy.scatter_host(views, slots[firsts[part.start]:firsts[part.stop]], layers,
                                   status[part.start:part.stop])
            freed[g % 2] = done = torch.cuda.Event()
            done.record(stream)
        for buf in ring:
            buf.record_stream(stream)

    def _ring(self, dtype: torch.dtype, hosts: Sequence[torch.Tensor],
              parts: Sequence[range]) -> list[torch.Tensor]:
        """Two staging buffers (one if there is one group), each as large as the largest
        group, on the current stream."""
        most = max(sum(hosts[c].numel() for c in part) for part in parts)
        return [torch.empty(most, dtype=dtype, device=self.device)
                for _ in range(min(2, len(parts)))]


def _firsts(hosts: Sequence[torch.Tensor]) -> list[int]:
    """The first token of each chunk in the concatenated slots, and the total at the end."""
    out = [0]
    for h in hosts:
        out.append(out[-1] + h.shape[1])
    return out


def _views(buf: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of `buf` shaped as `like`."""
    out, at = [], 0
    for t in like:
        out.append(buf[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out
