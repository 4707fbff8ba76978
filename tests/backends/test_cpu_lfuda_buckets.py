"""The lfuda queue's buckets (`FrequencyLeaves`, one `OrderedDict` per priority) decide as the
heap before them did (`tests/backends/lfuda_heap.py`, kvtier at 15da8f7): the same victims, the
same eviction order of every leaf, the same age and ghost list, on a random workload of stores,
hits (some held while evictions run), pins, removals and evictions by two tenants under a
share. Fails if the buckets order ties, requeues or stale leaves otherwise than the heap."""

from __future__ import annotations

import random

import pytest

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.backends.cpu_lfuda import FrequencyLeaves, LFUDABackend
from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, MemoryObj
from tests.backends.cpu_ops import LAYOUT, put
from tests.backends.lfuda_heap import HeapLFUDA
from tests.helpers import make_keys

CHUNK_BYTES = LAYOUT.nbytes(16)
HOLD = 24  # chunks the workload keeps in the tier (its arena holds more: no evictor here)


def _tier(cls: type[CPUBackend], share: float) -> tuple[CPUBackend, MemoryAllocator]:
    alloc = MemoryAllocator(4 * HOLD * 4096, pin=False)
    cfg = Config(chunk_size=16, max_local_cpu_size=HOLD * 4096 / 1e9, eviction_policy="lfuda",
                 tenant_max_fraction=share)
    return cls(BackendContext(cfg, LAYOUT, alloc)), alloc


def _prompts(rng: random.Random) -> list[list[ChunkKey]]:
    """Prompts of 1-6 chunks by two tenants, many sharing a prefix with another."""
    out = []
    for seed in range(12):
        keys = make_keys(16 * rng.randint(2, 6), layout=LAYOUT, seed=seed)
        salt = "a" if seed % 3 else "b"
        out.append([k._replace(salt=salt) for k in keys])
    return out


def _evict(cpu: CPUBackend, chunks: int) -> list[str]:
    out = []
    for key, obj in cpu.pop_lru(chunks * CHUNK_BYTES):
        out.append(key.key)
        obj.release()
    return out


def _state(cpu: CPUBackend) -> tuple:
    freq = cpu._leaves  # noqa: SLF001
    return (list(freq), sorted(cpu._entries), freq.age, freq.ghost_keys(),  # noqa: SLF001
            cpu.tenant_bytes())


def _step(cpu: CPUBackend, alloc: MemoryAllocator, op: tuple, held: list[MemoryObj]) -> object:
    kind, keys, n = op
    if kind == "put":
        gone = _evict(cpu, max(0, len(cpu._entries) + len(keys) - HOLD))  # noqa: SLF001
        put(cpu, alloc, keys)
        return gone
    if kind == "get":
        got = cpu.batch_get(keys)
        if n == 1:  # held while the next operations run: in use, skipped by evictions
            held.extend(got)
        else:
            for obj in got:
                obj.release()
        return len(got)
    if kind == "release":
        for obj in held:
            obj.release()
        held.clear()
        return None
    if kind == "pin":
        return cpu.pin(keys)
    if kind == "unpin":
        cpu.unpin(keys[:n])
        return None
    if kind == "remove":
        return cpu.remove(keys[-1:])
    return _evict(cpu, n)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("share", [1.0, 0.5])
def test_the_buckets_decide_as_the_heap_did(seed: int, share: float) -> None:
    rng = random.Random(seed)
    prompts = _prompts(rng)
    new, new_alloc = _tier(LFUDABackend, share)
    old, old_alloc = _tier(HeapLFUDA, share)
    assert isinstance(new._leaves, FrequencyLeaves)  # noqa: SLF001
    new_held: list[MemoryObj] = []
    old_held: list[MemoryObj] = []
    pinned: list[list[ChunkKey]] = []
    evictions = 0
    for i in range(1500):
        kind = rng.choices(["put", "get", "release", "pin", "unpin", "remove", "evict"],
                           [10, 10, 2, 1, 1, 1, 2])[0]
        keys = rng.choice(prompts)[: rng.randint(1, 6)]
        n = rng.randint(1, 3)
        if kind == "pin":
            pinned.append(keys)
        elif kind == "unpin":
            if not pinned:
                continue
            keys = pinned.pop(rng.randrange(len(pinned)))
            n = new.batch_contains(keys)  # what the pin took: the held prefix then
            n = min(n, old.batch_contains(keys))
        op = (kind, keys, n)
        a = _step(new, new_alloc, op, new_held)
        b = _step(old, old_alloc, op, old_held)
        assert a == b, f"step {i} {kind}: {a} != {b}"
        assert _state(new) == _state(old), f"step {i} {kind}"
        evictions += len(a) if isinstance(a, list) else 0
    assert evictions > 300  # the workload evicted: the comparison covered the queue's order
    for tier, held in ((new, new_held), (old, old_held)):
        for obj in held:
            obj.release()
        tier.close()
