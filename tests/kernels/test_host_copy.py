"""The GPU path's host copies, as far as a CPU can run them: the sync-free PyTorch reference
(which also runs on CPU tensors) against the plain reference, status words included, and the
argument checks. tests/gpu/ runs the CUDA kernel against the same oracle."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.kernels import host_copy, ops
from kvtier.kernels.host_copy import STATUS_BAD, STATUS_SKIP
from tests.kernels.test_ops import DTYPES, make_pool, random_rows

N, SLOTS, HIDDEN = 4, 64, 24


def chunks_for(sizes: list[int], dtype: torch.dtype, seed: int = 7) -> list[torch.Tensor]:
    return [random_rows((N, t, HIDDEN), dtype, seed=seed + i) for i, t in enumerate(sizes)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_gather_host_matches_the_reference_chunk_by_chunk(dtype: torch.dtype) -> None:
    layers = make_pool(N, SLOTS, HIDDEN, dtype)
    sizes = [5, 0, 8, 3]
    slots = torch.randperm(SLOTS)[:sum(sizes)]
    outs = [torch.empty((N, t, HIDDEN), dtype=dtype) for t in sizes]
    status = torch.full((len(sizes),), -1, dtype=torch.int32)
    host_copy.reference_gather_host(layers, slots, outs, status)
    assert status.tolist() == [0, 0, 0, 0]
    start = 0
    for out, t in zip(outs, sizes):
        want = torch.empty_like(out)
        ops.reference_gather(layers, slots[start:start + t], want)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
        start += t


def test_reference_gather_host_flags_skip_and_bad_slots_per_chunk() -> None:
    layers = make_pool(N, SLOTS, HIDDEN, torch.float16)
    slots = torch.tensor([1, 2, -1, 4, 5, 6, SLOTS, 7, -5], dtype=torch.int64)
    outs = [torch.empty((N, 3, HIDDEN), dtype=torch.float16) for _ in range(3)]
    status = torch.zeros(3, dtype=torch.int32)
    host_copy.reference_gather_host(layers, slots, outs, status)
    assert status.tolist() == [STATUS_SKIP, 0, STATUS_BAD]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_scatter_host_matches_the_reference_with_skips(dtype: torch.dtype) -> None:
    sizes = [4, 6, 2]
    srcs = chunks_for(sizes, dtype)
    slots = torch.randperm(SLOTS)[:sum(sizes)]
    slots[[0, 5, 6, 11]] = -1  # skips at chunk edges, inside, and a last row
    want = make_pool(N, SLOTS, HIDDEN, dtype)
    got = [t.clone() for t in want]
    start = 0
    for src, t in zip(srcs, sizes):
        ops.reference_scatter(src, slots[start:start + t], want)
        start += t
    status = torch.full((3,), -1, dtype=torch.int32)
    host_copy.reference_scatter_host(srcs, slots, got, status)
    assert status.tolist() == [0, 0, 0]
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_reference_scatter_host_leaves_an_all_skipped_chunk_and_bad_rows_alone() -> None:
    srcs = chunks_for([3, 3], torch.float32)
    slots = torch.tensor([-1, -1, -1, 9, SLOTS + 3, 11], dtype=torch.int64)
    pool = make_pool(N, SLOTS, HIDDEN, torch.float32)
    before = [t.clone() for t in pool]
    status = torch.zeros(2, dtype=torch.int32)
    host_copy.reference_scatter_host(srcs, slots, pool, status)
    assert status.tolist() == [0, STATUS_BAD]
    for layer, (old, src) in enumerate(zip(before, srcs[1])):
        now, old, src = (t.view(torch.int32) for t in (pool[layer], old, src))  # NaNs: bits
        changed = (now != old).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= {9, 11}
        assert torch.equal(now[9], src[0]) and torch.equal(now[11], src[2])


def test_host_copies_need_a_cuda_pool_and_name_it() -> None:
    layers = make_pool(N, SLOTS, HIDDEN, torch.float16)
    out = [torch.empty((N, 2, HIDDEN), dtype=torch.float16)]
    status = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="layers must be on a CUDA device"):
        host_copy.gather_host(layers, torch.tensor([1, 2]), out, status)
    with pytest.raises(ValueError, match="layers must be on a CUDA device"):
        host_copy.scatter_host(out, torch.tensor([1, 2]), layers, status)


def test_copy_blocks_reads_the_environment_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_CUDA_COPY_BLOCKS", raising=False)
    assert host_copy.copy_blocks() == host_copy.DEFAULT_BLOCKS
    monkeypatch.setenv("KVTIER_CUDA_COPY_BLOCKS", "8")
    assert host_copy.copy_blocks() == 8
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv("KVTIER_CUDA_COPY_BLOCKS", bad)
        with pytest.raises(ConfigError, match=f"KVTIER_CUDA_COPY_BLOCKS.*{bad}"):
            host_copy.copy_blocks()
