"""The PyTorch reference of the copies in `kvtier.kernels.ops`: always available, the oracle
the compiled kernels are tested against, and what runs without them. No argument checks here
(`ops.gather`/`ops.scatter` make them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.kernels.checks import SKIP_SLOT

__all__ = ["copyable", "reference_gather", "reference_scatter"]


def reference_gather(
    layers: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor
) -> None:
    """The PyTorch reference of `gather` (no argument checks: call `gather` for those)."""
    for layer, dst in zip(layers, out, strict=True):
        torch.index_select(copyable(layer), 0, slots, out=copyable(dst))


def reference_scatter(
    src: torch.Tensor, slots: torch.Tensor, layers: Sequence[torch.Tensor]
) -> None:
    """The PyTorch reference of `scatter` (no argument checks: call `scatter` for those)."""
    keep = slots != SKIP_SLOT
    if not bool(keep.all()):
        # Rare (a partially loaded chunk): pay for one compacted copy of src.
        slots, src = slots[keep], src[:, keep]
    for layer, rows in zip(layers, src, strict=True):
        copyable(layer).index_copy_(0, slots, copyable(rows))


def copyable(t: torch.Tensor) -> torch.Tensor:
    # Index ops have no kernels for some 1-byte dtypes (fp8); a copy does not care about the
    # dtype, so view those as bytes. Wider dtypes stay as they are: their kernels are faster.
    return t if t.element_size() > 1 else t.view(torch.uint8)
