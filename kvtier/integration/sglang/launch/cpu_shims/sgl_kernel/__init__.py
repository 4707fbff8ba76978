"""A stand-in for SGLang's `sgl_kernel` on CPU (its CPU build is not on PyPI).

SGLang's CPU engine imports a handful of names from `sgl_kernel` at start-up; on a CPU without
AMX only `copy_all_layer_kv_cache_cpu` is ever called. That one is implemented here in PyTorch;
every other name resolves to a function that raises `NotImplementedError`, so a code path that
does need a real kernel fails loudly instead of computing garbage. Shipped in kvtier's package
but not importable as `sgl_kernel` until `kvtier.integration.sglang.cpu` puts this directory on
the PYTHONPATH of a CPU server (a GPU machine has the real package).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NoReturn

import torch

__version__ = "0.0.0+kvtier.cpu"


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copy slot rows `src_loc -> tgt_loc` in every buffer; a row is `strides[i]` bytes.

    `data_ptrs[i]` is the address of buffer i (SGLang passes raw pointers). All source rows are
    read before any target row is written, as the GPU kernel does, so overlapping sets are safe.
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64).cpu()
    src = src_loc.to(torch.int64).cpu()
    rows = int(max(int(tgt.max()), int(src.max()))) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        view[tgt] = view[src]


def _missing(name: str) -> Callable[..., NoReturn]:
    def kernel(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name} is not available in the CPU stand-in")

    kernel.__name__ = name
    return kernel


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
