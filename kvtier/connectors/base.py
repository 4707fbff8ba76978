"""The contract between a serving engine's paged KV pool and kvtier's memory objects."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.kernels import host_copy, ops
from kvtier.memory import KVLayout, MemoryObj

if TYPE_CHECKING:
    from kvtier.connectors.staging import Staging

__all__ = ["KVConnector"]


class KVConnector(ABC):
    """Moves chunks between a paged KV pool and memory objects.

    `slots` are 1-D int64 tensors on the pool's device holding one pool row per token. Gather
    needs every slot valid; scatter skips `-1` slots. Implementations check arguments and raise
    `ValueError` naming the argument before a byte is read or written (the slot checks live in
    `ops`, once per copy; `check_slots` is for callers validating a whole request up front).
    """

    layout: KVLayout
    num_slots: int
    device: torch.device
    _layers: ops.CheckedLayers  # the pool as `[num_slots, hidden]` rows, in a chunk's order

    @abstractmethod
    def gather(self, slots: torch.Tensor, out: MemoryObj) -> None:
        """Copy the KV of `slots` (all layers) into `out` (`out.num_tokens == len(slots)`)."""

    @abstractmethod
    def scatter(self, obj: MemoryObj, slots: torch.Tensor) -> None:
        """Copy `obj` into the pool rows `slots`; `-1` slots are left untouched."""

    @property
    def pool_layers(self) -> tuple[torch.Tensor, ...]:
        """The pool's layer buffers, in a chunk's order (the engine's own tensors, not copies)."""
        return tuple(self._layers)

    def gather_many(self, slots: torch.Tensor, objs: Sequence[MemoryObj]) -> None:
        """`gather` into consecutive chunks, in one kernel call: `objs[i]` takes the next
        `objs[i].num_tokens` rows of `slots` (every slot valid)."""
        ops.gather_chunks(self._layers, slots, self._planes(objs, "objs"))

    def scatter_many(self, objs: Sequence[MemoryObj], slots: torch.Tensor) -> None:
        """`scatter` of consecutive chunks, in one kernel call: `objs[i]` goes to the next
        `objs[i].num_tokens` rows of `slots`."""
        ops.scatter_chunks(self._planes(objs, "objs"), slots, self._layers)

    def gather_host(self, slots: torch.Tensor, objs: Sequence[MemoryObj],
                    status: torch.Tensor, staging: Staging | None = None) -> None:
        """CUDA pools: enqueue the copy of the KV of `slots` into `objs` (consecutive chunks in
        the pinned arena) on the current stream, slots checked on the GPU into `status`; see
        `host_copy.gather_host`. With `staging`, through its GPU buffers and copy engines."""
        planes = self._planes(objs, "objs")
        if staging is not None:
            staging.gather(self._layers, slots, planes, status)
        else:
            host_copy.gather_host(self._layers, slots, planes, status)

    def scatter_host(self, objs: Sequence[MemoryObj], slots: torch.Tensor,
                     status: torch.Tensor, staging: Staging | None = None) -> None:
        """CUDA pools: enqueue the copy of `objs` (pinned arena) into the pool rows `slots` on
        the current stream; see `host_copy.scatter_host`. `objs` must stay leased until the
        copy has run. With `staging`, through its GPU buffers and copy engines."""
        planes = self._planes(objs, "objs")
        if staging is not None:
            staging.scatter(planes, slots, self._layers, status)
        else:
            host_copy.scatter_host(planes, slots, self._layers, status)

    def _planes(self, objs: Sequence[MemoryObj], name: str) -> list[torch.Tensor]:
        """Each object's tensor as `[planes * layers, tokens, hidden]`, the pool layers' order
        (the kernels check shapes and dtypes; only the format is Python's to see)."""
        out = []
        for obj in objs:
            if obj.fmt is not self.layout.fmt:
                raise ValueError(f"{name} hold {obj.fmt.name} chunks, expected "
                                 f"{self.layout.fmt.name}")
            t = obj.tensor
            out.append(t.view(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]))
        return out

    def check_slots(self, slots: torch.Tensor, *, name: str = "slots",
                    allow_skip: bool = True) -> int | None:
        """`ValueError` naming `name` unless `slots` is a valid slot vector for this pool: a
        1-D, contiguous int64 tensor on the pool's device, every value in range. Returns the
        smallest slot (None on a GPU, whose values the kernels check; 0 when empty)."""
        if not isinstance(slots, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(slots).__name__}")
        if slots.dim() != 1 or slots.dtype != torch.int64:
            raise ValueError(f"{name} must be a 1-D int64 tensor, got {slots.dtype} "
                             f"of shape {tuple(slots.shape)}")
        if slots.device != self.device:
            raise ValueError(f"{name} is on {slots.device}, the KV pool is on {self.device}")
        if not slots.is_contiguous():
            # The copy kernels need contiguous slot vectors; finding out at the second chunk
            # would leave the first one written.
            raise ValueError(f"{name} must be contiguous (call .contiguous() on it)")
        # On a GPU the copy kernels check the values (reading them here would wait for the GPU).
        if slots.device.type == "cuda":
            return None
        if not slots.numel():
            return 0
        lo, hi = ops.slot_bounds(slots) or torch.stack(torch.aminmax(slots)).tolist()
        low_ok = -1 if allow_skip else 0
        if lo < low_ok or hi >= self.num_slots:
            raise ValueError(f"{name} out of range: values in [{lo}, {hi}], pool has "
                             f"{self.num_slots} slots" + (" (-1 = skip)" if allow_skip
                                                          else ""))
        return int(lo)

    def check_obj(self, obj: MemoryObj, slots: torch.Tensor, *, name: str) -> None:
        """`ValueError` unless `obj` holds one token per slot in this pool's layout."""
        if not isinstance(slots, torch.Tensor):
            raise ValueError(f"slots must be a torch.Tensor, got {type(slots).__name__}")
        want = self.layout.shape(slots.numel())
        if obj.fmt is not self.layout.fmt or tuple(obj.tensor.shape) != want or \
                obj.tensor.dtype != self.layout.dtype:
            raise ValueError(f"{name} is {obj.fmt.name} {tuple(obj.tensor.shape)} "
                             f"{obj.tensor.dtype}, expected {self.layout.fmt.name} {want} "
                             f"{self.layout.dtype}")


def check_layer_buffers(buffers: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    """Validate per-layer `[slots, heads, dim]` buffers; return them as `[slots, hidden]` views."""
    if not isinstance(buffers, (list, tuple)) or not buffers:
        raise ValueError(f"{name} must be a non-empty list of per-layer tensors")
    first = buffers[0]
    flat = []
    for i, buf in enumerate(buffers):
        if not isinstance(buf, torch.Tensor) or buf.dim() != 3:
            raise ValueError(f"{name}[{i}] must be a 3-D [slots, heads, dim] tensor")
        if buf.shape != first.shape or buf.dtype != first.dtype or buf.device != first.device:
            raise ValueError(f"{name}[{i}] is {tuple(buf.shape)} {buf.dtype} on {buf.device}, "
                             f"{name}[0] is {tuple(first.shape)} {first.dtype} on {first.device}")
        if not buf.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous")
        flat.append(buf.view(buf.shape[0], -1))
    return flat
