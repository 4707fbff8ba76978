"""The CPU tier under `eviction_policy: lfuda` (`kvtier.backends.cpu_lfuda`): a prefix served
again outlives a burst of one-off prompts stored after it (under `lru` it goes first), a count
resumes from the ghost list when an evicted prefix comes back, the tier ages to what it
evicts, and eviction still takes unpinned leaves only (never a hole in a prefix)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.backends.cpu_lfuda import FrequencyLeaves, LFUDABackend
from kvtier.backends.cpu_tier import CPUTier
from kvtier.config import Config
from kvtier.memory import MemoryAllocator
from tests.backends.cpu_ops import LAYOUT, OP, apply_ops, put, unpinned_leaves
from tests.helpers import make_keys

CHUNK_BYTES = LAYOUT.nbytes(16)


def _tier(policy: str, chunks: int = 16) -> tuple[CPUBackend, MemoryAllocator]:
    alloc = MemoryAllocator(chunks * 4096, pin=False)
    cfg = Config(chunk_size=16, max_local_cpu_size=chunks * 4096 / 1e9, eviction_policy=policy)
    cpu = CPUTier(BackendContext(cfg, LAYOUT, alloc))
    assert isinstance(cpu, LFUDABackend) == (policy == "lfuda")
    return cpu, alloc


def _evict(cpu: CPUBackend, chunks: int) -> list[str]:
    out = []
    for key, obj in cpu.pop_lru(chunks * CHUNK_BYTES):
        out.append(key.key)
        obj.release()
    return out


def _serve(cpu: CPUBackend, keys: list) -> int:  # noqa: ANN001 - ChunkKeys
    got = cpu.batch_get(keys)
    for obj in got:
        obj.release()
    return len(got)


@pytest.mark.parametrize("policy", ["lru", "lfuda"])
def test_a_reused_prefix_outlives_a_burst_of_one_off_prompts(policy: str) -> None:
    cpu, alloc = _tier(policy)
    p = make_keys(4 * 16, layout=LAYOUT, seed=1)
    put(cpu, alloc, p)
    assert _serve(cpu, p) == 4  # served once after its store: two uses a chunk
    burst = [make_keys(2 * 16, layout=LAYOUT, seed=s) for s in range(10, 18)]
    gone: list[str] = []
    for q in burst:  # 16 one-off chunks, each store evicting once the 16 are full
        gone += _evict(cpu, max(0, len(cpu._entries) + 2 - 16))  # noqa: SLF001
        put(cpu, alloc, q)
    p_keys = {k.key for k in p}
    if policy == "lru":  # the least recent: p, taken from its end
        assert gone == [k.key for k in reversed(p)]
        assert cpu.batch_contains(p) == 0
    else:  # the burst's oldest leaves went (a parent left a leaf queues after them); p whole
        assert not p_keys & set(gone)
        assert gone == [burst[i][1].key for i in range(4)]
        assert cpu.batch_contains(p) == 4
    cpu.close()


def test_an_evicted_prefix_resumes_its_count_and_the_tier_ages_to_its_victims() -> None:
    cpu, alloc = _tier("lfuda", 4)
    p, q = make_keys(2 * 16, layout=LAYOUT, seed=1), make_keys(2 * 16, layout=LAYOUT, seed=2)
    put(cpu, alloc, p)
    _serve(cpu, p)
    _serve(cpu, p)  # 3 uses a chunk
    assert _evict(cpu, 2) == [p[1].key, p[0].key]  # the only leaves: a chain from its end
    freq: FrequencyLeaves = cpu._freq  # noqa: SLF001
    assert freq.age == 3 and freq.ghost_keys() == 2
    put(cpu, alloc, q)  # first seen: age + 1
    put(cpu, alloc, p)  # came back: its 3 uses resume, the store is a fourth
    assert freq.counted(p[1].key) == 4 and freq.ghost_keys() == 0
    assert _evict(cpu, 2) == [q[1].key, q[0].key]  # 3 + 1 < 3 + 4
    cpu.close()


def test_a_leaf_in_use_is_skipped_and_the_next_by_priority_goes() -> None:
    cpu, alloc = _tier("lfuda", 8)
    a, b, c = (make_keys(16, layout=LAYOUT, seed=s) for s in (1, 2, 3))
    for keys in (a, b, c):
        put(cpu, alloc, keys)
    held = cpu.batch_get(a)  # 2 uses, and held by the caller right now
    for keys in (b, c, b, c):
        _serve(cpu, keys)  # 3 uses each, b queued first
    assert _evict(cpu, 1) == [b[0].key]  # a is the least used but in use: the next one
    assert _evict(cpu, 1) == [c[0].key]
    assert _evict(cpu, 1) == []  # only a is left, still in use
    for obj in held:
        obj.release()
    assert _evict(cpu, 1) == [a[0].key]
    cpu.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(OP, max_size=40))
def test_lfuda_evicts_unpinned_leaves_only(ops) -> None:  # noqa: ANN001
    cpu, alloc = _tier("lfuda", 64)

    def candidates_exact(tier: CPUBackend) -> None:
        leaves: FrequencyLeaves = tier._leaves  # noqa: SLF001
        assert set(leaves) == unpinned_leaves(tier) and len(leaves) == len(set(leaves))

    apply_ops(cpu, alloc, ops, candidates_exact)
    cpu.close()
