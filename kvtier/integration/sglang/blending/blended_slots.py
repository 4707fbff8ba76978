"""Which pool slots hold blended KV: approximate, so a store stops before them
(`rank.store_hooks`) and an exact match never runs into them (`blend_hooks`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtier.integration.sglang.boundary.sglang_views import Opaque

__all__ = ["BlendedSlots"]


class BlendedSlots:
    """Which pool slots hold blended KV. A mark is set when a blend writes a slot and cleared
    when the allocator frees it (its `free` is wrapped) or the pool is reset."""

    def __init__(self, allocator: Opaque, num_slots: int, device: torch.device):
        self._marks = torch.zeros(num_slots, dtype=torch.bool, device=device)
        original: Callable[[torch.Tensor], Opaque] = allocator.free

        def free(free_index: torch.Tensor) -> Opaque:
            self._marks[free_index.to(self._marks.device, torch.int64)] = False
            return original(free_index)

        allocator.free = free

    def mark(self, slots: torch.Tensor) -> None:
        self._marks[slots.to(self._marks.device, torch.int64)] = True

    def exact_prefix(self, slots: torch.Tensor) -> int:
        """How many leading `slots` hold no blended KV."""
        marked = self._marks[slots.to(self._marks.device, torch.int64)].nonzero()
        return int(marked[0, 0]) if len(marked) else len(slots)

    def clear(self) -> None:
        self._marks.zero_()
