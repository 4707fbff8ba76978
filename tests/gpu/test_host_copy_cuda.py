"""The CUDA host-copy kernel (pool on the GPU, chunks in pinned host memory) against the PyTorch
reference, byte for byte, with the slot checks it does on the GPU."""

from __future__ import annotations

import pytest
import torch

from kvtier.kernels import ops
from kvtier.kernels.host_copy import STATUS_BAD, STATUS_SKIP, gather_host, scatter_host
from tests.gpu import cuda
from tests.kernels.test_ops import DTYPES, random_rows

pytestmark = cuda

SLOTS = 4096


def pool(n: int, hidden: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [random_rows((SLOTS, hidden), dtype, seed=i).cuda() for i in range(n)]


def pinned(n: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return random_rows((n, tokens, hidden), dtype, seed=seed).pin_memory()


def status_for(n: int) -> torch.Tensor:
    return torch.full((n,), -1, dtype=torch.int32).pin_memory()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = (t.cpu().contiguous().view(torch.uint8) for t in (a, b))
    return torch.equal(a, b)


def test_the_cuda_kernel_is_built_and_used() -> None:
    assert ops.prepare() == "cuda", "the CUDA kernel did not build (is nvcc on PATH / CUDA_HOME?)"


# (layers, hidden): MHA-like rows of 2 KiB and 256 B, an MLA row of 576 values, odd bytes.
SHAPES = [(64, 1024), (8, 128), (61, 576), (3, 7)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hidden", SHAPES)
def test_gather_host_is_byte_exact(dtype: torch.dtype, n: int, hidden: int) -> None:
    ops.prepare()
    layers = pool(n, hidden, dtype)
    sizes = [256, 0, 256, 37]
    slots = torch.randperm(SLOTS, device="cuda")[:sum(sizes)]
    outs = [torch.empty((n, t, hidden), dtype=dtype).pin_memory() for t in sizes]
    status = status_for(len(sizes))
    gather_host(layers, slots, outs, status)
    torch.cuda.synchronize()
    assert status.tolist() == [0] * len(sizes)
    start = 0
    for out, t in zip(outs, sizes):
        want = torch.empty((n, t, hidden), dtype=dtype, device="cuda")
        ops.reference_gather(layers, slots[start:start + t], want)
        assert same(out, want)
        start += t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hidden", SHAPES)
def test_scatter_host_is_byte_exact_and_skips(dtype: torch.dtype, n: int, hidden: int) -> None:
    ops.prepare()
    sizes = [256, 100]
    srcs = [pinned(n, t, hidden, dtype, seed=50 + i) for i, t in enumerate(sizes)]
    slots = torch.randperm(SLOTS, device="cuda")[:sum(sizes)]
    slots[[0, 17, 255, 256, 355]] = -1
    got, want = pool(n, hidden, dtype), pool(n, hidden, dtype)
    status = status_for(len(sizes))
    scatter_host(srcs, slots, got, status)
    start = 0
    for src, t in zip(srcs, sizes):
        ops.reference_scatter(src.cuda(), slots[start:start + t], want)
        start += t
    torch.cuda.synchronize()
    assert status.tolist() == [0, 0]
    assert all(same(a, b) for a, b in zip(got, want))


def test_bad_slots_are_flagged_on_the_gpu_and_their_rows_left_alone() -> None:
    ops.prepare()
    n, hidden, dtype = 4, 64, torch.bfloat16
    layers = pool(n, hidden, dtype)
    before = [t.clone() for t in layers]
    slots = torch.tensor([1, 2, 3, 4, -1, 6, SLOTS, 8, -7], device="cuda")
    srcs = [pinned(n, 3, hidden, dtype, seed=i) for i in range(3)]
    status = status_for(3)
    scatter_host(srcs, slots, layers, status)
    torch.cuda.synchronize()
    assert status.tolist() == [0, 0, STATUS_BAD]  # -1 in a scatter is a skip, not an error
    assert same(layers[0][SLOTS - 1], before[0][SLOTS - 1])
    outs = [torch.empty((n, 3, hidden), dtype=dtype).pin_memory() for _ in range(3)]
    status = status_for(3)
    gather_host(layers, slots, outs, status)
    torch.cuda.synchronize()
    assert status.tolist() == [0, STATUS_SKIP, STATUS_BAD]


def test_pageable_chunks_are_refused_before_anything_runs() -> None:
    ops.prepare()
    layers = pool(2, 64, torch.float16)
    outs = [torch.empty((2, 4, 64), dtype=torch.float16)]  # not pinned
    with pytest.raises(ValueError, match=r"outs\[0\].*pinned"):
        gather_host(layers, torch.arange(4, device="cuda"), outs, status_for(1))
