"""The CPU tier's eviction order under random puts, reads, pins and evictions: only leaves go
(never a chunk whose child is cached, never a pinned one), and the candidates it keeps always
equal what it may evict (issue 51, item 9: eviction walked past every pinned chunk)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.memory import MemoryAllocator
from tests.backends.cpu_ops import LAYOUT, OP, apply_ops, unpinned_leaves


@settings(max_examples=60, deadline=None)
@given(st.lists(OP, max_size=40))
def test_only_unpinned_leaves_are_evicted_and_the_candidates_stay_exact(ops) -> None:  # noqa: ANN001
    alloc = MemoryAllocator(1 << 24, pin=False)
    cpu = CPUBackend(BackendContext(Config(chunk_size=16, max_local_cpu_size=0.02,
                                           eviction_policy="lru"), LAYOUT, alloc))

    def candidates_exact(tier: CPUBackend) -> None:
        assert set(tier._leaves) == unpinned_leaves(tier)  # noqa: SLF001

    apply_ops(cpu, alloc, ops, candidates_exact)
    cpu.close()
