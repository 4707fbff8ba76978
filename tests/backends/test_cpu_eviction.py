"""The CPU tier's eviction order under random puts, reads, pins and evictions: only leaves go
(never a chunk whose child is cached, never a pinned one), and the candidates it keeps always
equal what it may evict (issue 51, item 9: eviction walked past every pinned chunk)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.memory import KVLayout, MemoryAllocator
from tests.helpers import make_keys, make_obj

LAYOUT = KVLayout.mha(1, 1, 16, torch.float16)
PROMPTS = [make_keys(16 * 4, layout=LAYOUT, seed=s) for s in range(6)]

op = st.tuples(st.sampled_from(["put", "get", "pin", "unpin", "evict", "remove"]),
               st.integers(0, len(PROMPTS) - 1), st.integers(1, 4))


@settings(max_examples=60, deadline=None)
@given(st.lists(op, max_size=40))
def test_only_unpinned_leaves_are_evicted_and_the_candidates_stay_exact(ops) -> None:  # noqa: ANN001
    alloc = MemoryAllocator(1 << 24, pin=False)
    cpu = CPUBackend(BackendContext(Config(chunk_size=16, max_local_cpu_size=0.02,
                                           eviction_policy="lru"), LAYOUT, alloc))
    pins: dict[int, int] = {}
    for kind, p, n in ops:
        keys = PROMPTS[p][:n]
        if kind == "put":
            objs = [make_obj(alloc, LAYOUT, k.num_tokens, 0) for k in keys]
            cpu.batch_put(keys, objs)
            for o in objs:
                o.release()
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
            cached = set(cpu._entries)  # noqa: SLF001 - the invariant's subject
            gone: set[str] = set()
            for key, obj in cpu.pop_lru(n * LAYOUT.nbytes(16)):
                kids = {k.key for k in PROMPTS_FLAT if k.prev == key.key and k.key in cached}
                assert kids <= gone, "a chunk went while its child was cached"
                assert key.key not in cpu._pins, "a pinned chunk was evicted"  # noqa: SLF001
                gone.add(key.key)
                obj.release()
        entries, children, pinned = cpu._entries, cpu._children, cpu._pins  # noqa: SLF001
        want = [n for n in entries if not children.get(n) and n not in pinned]
        assert set(cpu._leaves) == set(want)  # noqa: SLF001
    cpu.close()


PROMPTS_FLAT = [k for keys in PROMPTS for k in keys]
