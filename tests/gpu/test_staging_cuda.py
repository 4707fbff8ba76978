"""The staged pipeline (`connectors.staging`): the copy kernel into GPU buffers and the copy
engines' memcpys, against the PyTorch reference byte for byte, over several groups, chunks
contiguous in one host buffer and scattered ones, and the slot checks' status words."""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors import staging
from kvtier.kernels import ops
from kvtier.kernels.host_copy import STATUS_BAD, STATUS_SKIP
from tests.gpu import cuda
from tests.gpu.test_host_copy_cuda import SLOTS, pinned, pool, same, status_for

pytestmark = cuda


def chunks(n: int, sizes: list[int], hidden: int, dtype: torch.dtype, *,
           one_buffer: bool) -> list[torch.Tensor]:
    """Pinned `[n, t, hidden]` chunks: views of one buffer in order (one memcpy a group), or
    separate allocations."""
    if not one_buffer:
        return [pinned(n, t, hidden, dtype, seed=90 + i) for i, t in enumerate(sizes)]
    flat = pinned(1, sum(sizes) * n, hidden, dtype, seed=7).view(-1)
    out, at = [], 0
    for t in sizes:
        out.append(flat[at:at + n * t * hidden].view(n, t, hidden))
        at += n * t * hidden
    return out


def small_groups() -> staging.Staging:
    """Groups of about 64 KiB, so a few chunks make several groups and the ring turns."""
    return staging.Staging(torch.device("cuda", torch.cuda.current_device()), 64 << 10)


@pytest.mark.parametrize("one_buffer", [True, False])
@pytest.mark.parametrize("dtype,hidden", [(torch.bfloat16, 1024), (torch.float32, 576),
                                          (torch.float16, 7)])
def test_staged_round_trip_is_byte_exact(dtype: torch.dtype, hidden: int,
                                         one_buffer: bool) -> None:
    ops.prepare()
    n, sizes = 6, [16, 16, 5, 16, 0, 16, 16, 3]
    stage = small_groups()
    layers = pool(n, hidden, dtype)
    slots = torch.randperm(SLOTS, device="cuda")[:sum(sizes)]
    outs = chunks(n, sizes, hidden, dtype, one_buffer=one_buffer)
    status = status_for(len(sizes))
    stage.gather(layers, slots, outs, status)
    torch.cuda.current_stream().synchronize()  # the stream the call enqueued on covers it all
    assert status.tolist() == [0] * len(sizes)
    start = 0
    for out, t in zip(outs, sizes):
        want = torch.empty((n, t, hidden), dtype=dtype, device="cuda")
        ops.reference_gather(layers, slots[start:start + t], want)
        assert same(out, want)
        start += t

    back = [torch.zeros_like(t) for t in layers]
    dst = torch.randperm(SLOTS, device="cuda")[:sum(sizes)]
    dst[[0, 40]] = -1  # left alone
    status = status_for(len(sizes))
    stage.scatter(outs, dst, back, status)
    torch.cuda.current_stream().synchronize()
    assert status.tolist() == [0] * len(sizes)
    keep = dst >= 0
    assert all(same(b[dst[keep]], a[slots[keep]]) for a, b in zip(layers, back))
    untouched = torch.ones(SLOTS, dtype=torch.bool, device="cuda")
    untouched[dst[keep]] = False
    assert all(int(b[untouched].count_nonzero()) == 0 for b in back)


def test_staged_copies_flag_skip_and_bad_slots_per_chunk() -> None:
    ops.prepare()
    n, hidden, dtype = 4, 1024, torch.bfloat16
    stage = small_groups()
    layers = pool(n, hidden, dtype)
    before = [t.clone() for t in layers]
    sizes = [8, 8, 8, 8]
    slots = torch.randperm(SLOTS - 1, device="cuda")[:32]
    slots[9] = -1  # chunk 1: a skip
    slots[20] = SLOTS  # chunk 2: out of range
    outs = chunks(n, sizes, hidden, dtype, one_buffer=False)
    status = status_for(4)
    stage.gather(layers, slots, outs, status)
    torch.cuda.current_stream().synchronize()
    assert status.tolist() == [0, STATUS_SKIP, STATUS_BAD, 0]
    status = status_for(4)
    stage.scatter(outs, slots, layers, status)
    torch.cuda.current_stream().synchronize()
    assert status.tolist() == [0, 0, STATUS_BAD, 0]  # -1 in a scatter is a skip
    assert all(same(a, b) for a, b in zip(layers, before))  # the same bytes written back
