"""Transparent huge pages under a CPU KV pool.

A CPU pool is read and written one token row (a few KiB) at a time at random slots: on 4 KiB
pages nearly every row is a TLB miss and a page walk, and under a hypervisor a nested one. On
2 MiB pages the connector's random-row copies ran 1.3-2.2x faster on a 2-core KVM guest
(`benchmarks/micro/bench_connectors.py --compare-pages`). The serving engine allocates the pool: an
SGLang `--device cpu` launch has PyTorch put it on huge pages as it is created
(`THP_MEM_ALLOC_ENABLE=1`, set by `integration.sglang.cpu`), and the worker then collapses in
place (`MADV_COLLAPSE`, Linux 6.1+), once, at launch, whatever is still on small pages. (The
arena gains nothing measurable: its chunks are read and written in order.)

Best effort throughout: where the kernel refuses (not Linux, THP disabled, an old kernel, no
free 2 MiB pages), memory keeps its small pages and every copy stays correct; the result says
what happened, for one log line. The contents never change.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = ["HugePages", "back"]

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
_PMD_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


class HugePages(NamedTuple):
    """What `back` did: bytes advised and collapsed, its time, and the first refusal."""

    advised: int
    collapsed: int
    seconds: float
    error: str | None  # e.g. "MADV_COLLAPSE: EINVAL"; None when the kernel took every range

    def describe(self) -> str:
        """One log line's worth, e.g. "2.15 GB advised for huge pages, 2.15 GB collapsed in
        2.2 s"."""
        text = f"{self.advised / 1e9:.2f} GB advised for huge pages"
        if self.collapsed:
            text += f", {self.collapsed / 1e9:.2f} GB collapsed in {self.seconds:.1f} s"
        return text + (f" ({self.error}: small pages kept there)" if self.error else "")


def back(tensors: Iterable[torch.Tensor], *, collapse: bool = False) -> HugePages:
    """Ask the kernel to back the whole huge pages inside each CPU tensor's memory with huge
    pages (`madvise(MADV_HUGEPAGE)`); with `collapse`, also move what they already hold onto
    huge pages now (`MADV_COLLAPSE`). Tensors off the CPU and ranges below one huge page are
    left alone. Never raises for a refusal: it is in the result."""
    start = time.monotonic()
    advised = collapsed = 0
    error = None
    libc = _libc()
    for begin, end in _ranges(tensors, _huge_page_size()):
        if libc is None:
            error = f"huge pages need Linux (this is {sys.platform})"
            break
        failed = _madvise(libc, begin, end - begin, MADV_HUGEPAGE, "MADV_HUGEPAGE")
        if failed is None:
            advised += end - begin
            if collapse:
                failed = _madvise(libc, begin, end - begin, MADV_COLLAPSE, "MADV_COLLAPSE")
                collapsed += (end - begin) if failed is None else 0
        error = error or failed
    return HugePages(advised, collapsed, time.monotonic() - start, error)


def _ranges(tensors: Iterable[torch.Tensor], huge: int) -> list[tuple[int, int]]:
    """The huge-page-aligned interior of each CPU tensor's storage, each storage once."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if t.device.type != "cpu":  # only host memory has pages to advise
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        begin, end = -(-ptr // huge) * huge, (ptr + storage.nbytes()) // huge * huge
        if end > begin:
            out.append((begin, end))
    return out


def _madvise(libc: ctypes.CDLL, addr: int, length: int, advice: int, name: str) -> str | None:
    if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0:
        return None
    code = ctypes.get_errno()
    return f"{name}: {errno.errorcode.get(code, str(code))} ({os.strerror(code)})"


def _huge_page_size() -> int:
    try:
        return int(_PMD_SIZE.read_text())
    except (OSError, ValueError):
        return 2 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
