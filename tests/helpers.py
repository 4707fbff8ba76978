"""Small builders shared by the tests (no fixtures here; see conftest.py)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence

import pytest
import torch

from kvtier.keys import ChunkKey, KeyBuilder
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease

SMALL_MHA = KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
SMALL_MLA = KVLayout.mla(num_layers=3, kv_dim=24, dtype=torch.float16)


def make_keys(
    num_tokens: int,
    *,
    chunk_size: int = 16,
    layout: KVLayout = SMALL_MHA,
    model: str = "test-model",
    seed: int = 0,
    save_unfull_chunk: bool = True,
) -> list[ChunkKey]:
    """Keys of a random prompt of `num_tokens` tokens (same seed, same prompt)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (num_tokens,), generator=gen)
    kb = KeyBuilder(model=model, fingerprint=layout.fingerprint(chunk_size),
                    chunk_size=chunk_size, save_unfull_chunk=save_unfull_chunk)
    return kb.keys(tokens)


def make_obj(alloc: MemoryAllocator, layout: KVLayout, num_tokens: int, seed: int) -> MemoryObj:
    """A freshly allocated object filled with random bytes derived from `seed`."""
    obj = alloc.allocate(layout, num_tokens)
    assert obj is not None, "arena full"
    gen = torch.Generator().manual_seed(seed)
    obj.tensor.view(torch.uint8).copy_(
        torch.randint(0, 256, obj.tensor.view(torch.uint8).shape, dtype=torch.uint8,
                      generator=gen))
    return obj


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def put_random(put: Callable[[Sequence[ChunkKey], Sequence[MemoryObj]], int | None],
               alloc: MemoryAllocator, layout: KVLayout, keys: Sequence[ChunkKey],
               seed: int = 0) -> list[torch.Tensor]:
    """Put fresh random objects for `keys` through `put` (a tier's `batch_put`, which must
    store them all, or a manager's `put`); returns copies of what was put."""
    objs = [make_obj(alloc, layout, k.num_tokens, seed + i) for i, k in enumerate(keys)]
    want = [o.tensor.clone() for o in objs]
    with lease(objs):
        assert put(keys, objs) in (None, len(keys))
    return want


def run_threads(target: Callable[..., None], args: Iterable[tuple], timeout: float = 300) -> None:
    """Run `target(*a)` on a thread of its own for each `a`, all at once; re-raise the first
    exception any of them raised (an assertion in a thread must fail the test)."""
    errors: list[BaseException] = []

    def run(*a: object) -> None:
        try:
            target(*a)
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout}s"
    if errors:
        raise errors[0]


def os_thread_name() -> str:
    """The calling thread's name as the OS shows it (Linux's /proc comm)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
        return comm.read().strip()


def use_backend(monkeypatch: pytest.MonkeyPatch, name: str, target: str) -> None:
    """Serve tier `name` with the class `target` ("module:Class") for one test, through the
    tier table (the one place tiers are listed)."""
    from kvtier.config import tiers

    table = [dataclasses.replace(s, backend=target) if s.name == name else s
             for s in tiers.TABLE]
    monkeypatch.setattr(tiers, "TABLE", table)
