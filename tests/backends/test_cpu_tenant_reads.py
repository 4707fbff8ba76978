"""The CPU tier's reads per tenant (`tenant_bytes`, `keys_of`): what a tenant's purge and the
per-tenant metrics read, exact for each tenant and blind to the others."""

from __future__ import annotations

import pytest

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.backends.cpu_tier import CPUTier
from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import ALIGN, MemoryAllocator
from tests.backends.cpu_ops import LAYOUT, put
from tests.helpers import make_keys

CHUNKS = 16


def _tier(policy: str, fraction: float) -> tuple[CPUBackend, MemoryAllocator]:
    alloc = MemoryAllocator(CHUNKS * 4096, pin=False)
    cfg = Config(chunk_size=16, max_local_cpu_size=CHUNKS * 4096 / 1e9, eviction_policy=policy,
                 tenant_max_fraction=fraction)
    return CPUTier(BackendContext(cfg, LAYOUT, alloc)), alloc


def _prompt(seed: int, chunks: int, salt: str) -> list[ChunkKey]:
    return [k._replace(salt=salt) for k in make_keys(16 * chunks, layout=LAYOUT, seed=seed)]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_keys_and_bytes_per_tenant(policy: str) -> None:
    cpu, alloc = _tier(policy, 0.5)
    a, b, plain = _prompt(1, 3, "a"), _prompt(2, 2, "b"), _prompt(3, 1, "")
    for keys in (a, b, plain):
        put(cpu, alloc, keys)
    assert {k.key for k in cpu.keys_of("a")} == {k.key for k in a}
    assert {k.key for k in cpu.keys_of("b")} == {k.key for k in b}
    assert [k.key for k in cpu.keys_of("")] == [plain[0].key]
    assert cpu.keys_of("c") == []
    unit = -(-LAYOUT.nbytes(16) // ALIGN) * ALIGN
    assert cpu.tenant_bytes() == {"a": 3 * unit, "b": 2 * unit, "": unit}
    cpu.remove(a)
    assert cpu.keys_of("a") == [] and "a" not in cpu.tenant_bytes()
    cpu.close()


def test_no_share_counts_no_bytes_but_still_finds_keys() -> None:
    cpu, alloc = _tier("lru", 1.0)
    put(cpu, alloc, _prompt(1, 2, "a"))
    assert cpu.tenant_bytes() == {}
    assert len(cpu.keys_of("a")) == 2
    cpu.close()
