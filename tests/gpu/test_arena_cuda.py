"""The pinned arena's registration on a GPU: unregistered before its memory can be freed, also
when it is dropped without `close()`, and a failed runtime call leaves no error behind."""

from __future__ import annotations

import gc

import torch

from kvtier.memory import MemoryAllocator, clear_cuda_error
from tests.gpu import cuda

pytestmark = cuda


def register(t: torch.Tensor) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))


def unregister(t: torch.Tensor) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))


def test_an_arena_dropped_without_close_is_unregistered() -> None:
    arena = MemoryAllocator(1 << 22, pin=True)
    assert arena.raw.is_pinned()
    keep = arena.raw  # the memory outlives the allocator object
    del arena
    gc.collect()
    # Were it still registered, registering it again would fail (already registered).
    assert register(keep) == 0
    assert unregister(keep) == 0


def test_close_unregisters_once() -> None:
    arena = MemoryAllocator(1 << 22, pin=True)
    keep = arena.raw
    arena.close()
    arena.close()
    assert register(keep) == 0
    assert unregister(keep) == 0


def test_a_failed_runtime_call_does_not_fail_the_next_kernel() -> None:
    pageable = torch.empty(1 << 16, dtype=torch.uint8)
    assert unregister(pageable) != 0  # never registered: the runtime keeps an error code
    clear_cuda_error()
    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()  # a pending error would surface here or at the launch above
    assert float((x * 2).sum()) == 2048
