"""The CPU tier's share per tenant (`tenant_max_fraction`), under both eviction policies: a
tenant that stores far more than the tier loses its own chunks first while another tenant holds
chunks; a tenant alone is evicted exactly as without a share."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.backends.cpu_tier import CPUTier
from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator
from tests.backends.cpu_ops import LAYOUT, put
from tests.helpers import make_keys

CHUNKS = 16  # the tier, in chunks (one 4 KiB arena unit each)


def _tier(policy: str, fraction: float) -> tuple[CPUBackend, MemoryAllocator]:
    alloc = MemoryAllocator(CHUNKS * 4096, pin=False)
    cfg = Config(chunk_size=16, max_local_cpu_size=CHUNKS * 4096 / 1e9, eviction_policy=policy,
                 tenant_max_fraction=fraction)
    return CPUTier(BackendContext(cfg, LAYOUT, alloc)), alloc


def _prompt(seed: int, chunks: int, salt: str) -> list[ChunkKey]:
    return [k._replace(salt=salt) for k in make_keys(16 * chunks, layout=LAYOUT, seed=seed)]


def _store(cpu: CPUBackend, alloc: MemoryAllocator, keys: list[ChunkKey]) -> list[str]:
    """Stores `keys` as the storage manager does (room first, evicting); the evicted keys."""
    room = max(0, len(cpu._entries) + len(keys) - CHUNKS)  # noqa: SLF001 - arena in chunks
    gone = []
    for key, obj in cpu.pop_lru(room * LAYOUT.nbytes(16)):  # 1 KiB a chunk
        gone.append(key.key)
        obj.release()
    put(cpu, alloc, keys)
    return gone


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_noisy_tenant_evicts_its_own_chunks_past_its_share(policy: str,
                                                             fraction: float) -> None:
    cpu, alloc = _tier(policy, fraction)
    quiet = _prompt(100, 4, "b")
    _store(cpu, alloc, quiet)
    noisy = [_prompt(s, 4, "a") for s in range(3 * CHUNKS // 4)]  # 3x the tier
    for keys in noisy:
        _store(cpu, alloc, keys)
    assert cpu.batch_contains(noisy[-1]) == 4
    held = cpu.batch_contains(quiet)
    if fraction < 1:
        assert held == 4, "the quiet tenant lost chunks to a tenant over its share"
        assert cpu.stats()["share_evictions"] == cpu.stats()["evictions"] > 0
    else:  # no share: the noisy tenant pushes the quiet one out (what the share prevents)
        assert held == 0 and cpu.stats()["share_evictions"] == 0
    cpu.close()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_tenant_alone_is_evicted_as_without_a_share(policy: str) -> None:
    evicted = {}
    for fraction in (0.25, 1.0):
        cpu, alloc = _tier(policy, fraction)
        prompts = [_prompt(s, 1 + s % 3, "a") for s in range(20)]
        evicted[fraction] = [k for keys in prompts for k in _store(cpu, alloc, keys)]
        assert cpu.stats()["share_evictions"] == 0
        assert len(cpu._entries) == CHUNKS  # noqa: SLF001 - the whole tier is in use
        cpu.close()
    assert evicted[0.25] and evicted[0.25] == evicted[1.0]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_tenant_within_its_share_is_evicted_under_the_policy(policy: str) -> None:
    """With every tenant within its share the policy decides alone, and once the tenant over
    its share is back under it, the others' chunks go again: the share protects, it never
    reserves."""
    cpu, alloc = _tier(policy, 0.5)
    old_b = _prompt(1, 4, "b")
    _store(cpu, alloc, old_b)
    for s in range(3):  # a: 12 chunks, over its 8
        _store(cpu, alloc, _prompt(10 + s, 4, "a"))
    gone = _store(cpu, alloc, _prompt(2, 4, "b"))  # b stores: a (over its share) pays
    assert set(gone) == {k.key for k in _prompt(10, 4, "a")}
    assert cpu.batch_contains(old_b) == 4
    # a now holds 8 chunks (its share exactly), b 8: the policy's first leaf goes, b's oldest.
    gone = _store(cpu, alloc, _prompt(3, 1, "c"))
    assert gone == [old_b[-1].key]
    cpu.close()


@pytest.mark.parametrize("policy", ["lru", "arc"])
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "pin", "remove", "evict"]),
                              st.integers(0, 5), st.integers(1, 4)), max_size=40))
def test_the_tenants_bytes_stay_exact(policy: str, ops: list[tuple[str, int, int]]) -> None:
    """Under random puts, hits, pins, removals and evictions of three tenants' prompts, each
    tenant's count is what it holds, and the tenants over their share are exactly those."""
    cpu, alloc = _tier(policy, 0.25)
    prompts = [_prompt(200 + p, 4, "abc"[p % 3]) for p in range(6)]
    for kind, p, n in ops:
        keys = prompts[p][:n]
        if kind == "put":
            _store(cpu, alloc, keys)
        elif kind == "get":
            for obj in cpu.batch_get(keys):
                obj.release()
        elif kind == "pin":  # one prompt's chunks at most: the others keep room to evict
            cpu.pin(prompts[0][:n])
        elif kind == "remove":
            cpu.remove(keys[-1:])
        else:
            for _, obj in cpu.pop_lru(n * LAYOUT.nbytes(16)):
                obj.release()
        held: Counter[str] = Counter()
        for key, _ in cpu._entries.values():  # noqa: SLF001 - the count's subject
            held[key.salt] += 4096
        assert cpu._tenant_bytes == dict(held)  # noqa: SLF001
        assert cpu._over == {t for t, b in held.items() if b > CHUNKS * 4096 // 4}  # noqa: SLF001
    cpu.close()
