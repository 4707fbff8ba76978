"""The random operations the CPU tier's eviction property tests apply (put, get, pin, unpin,
evict, remove), and the invariant every policy keeps: only unpinned leaves are evicted, never a
chunk while its child is cached. Each test states its own candidate check after every step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from hypothesis import strategies as st

from kvtier.backends.cpu import CPUBackend
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator
from tests.helpers import make_keys, make_obj

LAYOUT = KVLayout.mha(1, 1, 16, torch.float16)  # 16 tokens: 1 KiB
PROMPTS = [make_keys(16 * 4, layout=LAYOUT, seed=s) for s in range(6)]
PROMPTS_FLAT = [k for keys in PROMPTS for k in keys]
OP = st.tuples(st.sampled_from(["put", "get", "pin", "unpin", "evict", "remove"]),
               st.integers(0, len(PROMPTS) - 1), st.integers(1, 4))


def put(cpu: CPUBackend, alloc: MemoryAllocator, keys: Sequence[ChunkKey]) -> None:
    objs = [make_obj(alloc, LAYOUT, k.num_tokens, 0) for k in keys]
    cpu.batch_put(list(keys), objs)
    for obj in objs:
        obj.release()


def apply_ops(cpu: CPUBackend, alloc: MemoryAllocator, ops: Sequence[tuple[str, int, int]],
              candidates_exact: Callable[[CPUBackend], None]) -> None:
    """Applies `ops` to `cpu`, checking the eviction invariant at each `evict` and
    `candidates_exact(cpu)` after every step."""
    pins: dict[int, int] = {}
    for kind, p, n in ops:
        keys = PROMPTS[p][:n]
        if kind == "put":
            put(cpu, alloc, keys)
        elif kind == "get":
            for o in cpu.batch_get(keys):
                o.release()
        elif kind == "pin":
            pins[p] = cpu.pin(PROMPTS[p])
        elif kind == "unpin" and p in pins:
            cpu.unpin(PROMPTS[p][:pins.pop(p)])
        elif kind == "remove":
            cpu.remove(keys[-1:])
        elif kind == "evict":
            _evict_leaves_only(cpu, n)
        candidates_exact(cpu)


def _evict_leaves_only(cpu: CPUBackend, chunks: int) -> None:
    cached = set(cpu._entries)  # noqa: SLF001 - the invariant's subject
    gone: set[str] = set()
    for key, obj in cpu.pop_lru(chunks * LAYOUT.nbytes(16)):
        kids = {k.key for k in PROMPTS_FLAT if k.prev == key.key and k.key in cached}
        assert kids <= gone, "a chunk went while its child was cached"
        assert key.key not in cpu._pins, "a pinned chunk was evicted"  # noqa: SLF001
        gone.add(key.key)
        obj.release()


def unpinned_leaves(cpu: CPUBackend) -> set[str]:
    entries, children, pinned = cpu._entries, cpu._children, cpu._pins  # noqa: SLF001
    return {n for n in entries if not children.get(n) and n not in pinned}
