"""Argument checks of the copies in `ops`: the reference path's, and the pool's layers checked
once (`CheckedLayers`). Each raises `ValueError` naming the bad argument before anything is
written; the compiled kernels make the same checks in C++ and need none of these but the layers'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CheckedLayers", "check", "check_slots", "check_values", "check_layers", "check_chunk",
           "describe", "SKIP_SLOT"]

SKIP_SLOT = -1  # in scatter: leave this token's pool row untouched


def check(
    layers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    chunk: torch.Tensor,
    chunk_name: str,
    allow_skip: bool,
) -> None:
    """Every argument of one `gather`/`scatter` (`chunk` named `chunk_name`)."""
    first = check_layers(layers)
    check_slots(slots, first, allow_skip, check_range=False)
    check_chunk(chunk, chunk_name, first, len(layers), slots.numel())
    check_values(slots, first, allow_skip)


def check_slots(slots: torch.Tensor, first: torch.Tensor, allow_skip: bool,
                check_range: bool = True) -> None:
    """A 1-D contiguous int64 slot vector on the layers' device; its values too with
    `check_range` (in `[-1, num_slots)` with `allow_skip`, else `[0, num_slots)`)."""
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"slots must be a 1-D int64 tensor, got {describe(slots)}")
    if slots.device != first.device:
        raise ValueError(f"slots is on {slots.device} but layers are on {first.device}")
    if not slots.is_contiguous():
        raise ValueError("slots must be contiguous")
    if check_range:
        check_values(slots, first, allow_skip)


def check_values(slots: torch.Tensor, first: torch.Tensor, allow_skip: bool) -> None:
    if slots.numel():
        # One pass; on a GPU one device sync, not two.
        lo, hi = torch.stack(torch.aminmax(slots)).tolist()  # one device sync, not two
        low = SKIP_SLOT if allow_skip else 0
        if lo < low or hi >= first.shape[0]:
            raise ValueError(
                f"slots must be in [{low}, {first.shape[0]}), got values in [{lo}, {hi}]"
            )


class CheckedLayers(tuple):  # type: ignore[type-arg]
    """Pool layers checked once (`check_layers`), for a caller that passes the same pool on
    every chunk (a connector): the copy functions skip the per-layer checks for them, which
    cost more than a small chunk's copy. A tensor's dtype, shape and device are fixed, so the
    check holds for as long as the tuple lives."""

    first: torch.Tensor

    def __new__(cls, layers: Sequence[torch.Tensor]) -> CheckedLayers:
        first = check_layers(layers)
        self = super().__new__(cls, layers)
        self.first = first
        return self


def check_layers(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Checks the layers agree with each other; returns the first."""
    if isinstance(layers, CheckedLayers):
        return layers.first
    if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence) or not layers:
        raise ValueError("layers must be a non-empty sequence of tensors")
    first = layers[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 2:
        raise ValueError(f"layers[0] must be a 2-D tensor [num_slots, hidden], got {first!r:.80}")
    shape, dtype, device = first.shape, first.dtype, first.device
    for i, layer in enumerate(layers):
        # One fast test per layer (this runs on every chunk); explain only on failure.
        if (
            isinstance(layer, torch.Tensor)
            and layer.dtype is dtype
            and layer.shape == shape
            and layer.device == device
            and layer.is_contiguous()
        ):
            continue
        if not isinstance(layer, torch.Tensor):
            raise ValueError(f"layers[{i}] must be a tensor, got {type(layer).__name__}")
        if not layer.is_contiguous():
            raise ValueError(f"layers[{i}] must be contiguous")
        raise ValueError(
            f"layers[{i}] is {layer.dtype} {tuple(layer.shape)} on {layer.device}; layers[0] "
            f"is {dtype} {tuple(shape)} on {device}: they must match"
        )
    return first


def check_chunk(
    chunk: torch.Tensor, name: str, first: torch.Tensor, num_layers: int, num_tokens: int
) -> None:
    if not isinstance(chunk, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(chunk).__name__}")
    if chunk.dtype != first.dtype or chunk.device != first.device:
        raise ValueError(
            f"{name} is {chunk.dtype} on {chunk.device}; layers are {first.dtype} on {first.device}"
        )
    expected = (num_layers, num_tokens, first.shape[1])
    if tuple(chunk.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(chunk.shape)}")
    if not chunk.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
