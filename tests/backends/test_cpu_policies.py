"""The CPU tier's eviction policies (`eviction_policy`): `lru` and `arc` (`CPUTier(ctx)`, the
tier table's CPU tier, builds the one configured). Under `arc` a burst of
first-seen prompts is evicted before a prefix that came back, however old that prefix is, and
eviction still takes leaves only (never a hole in a prefix)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.backends.cpu_arc import ARCBackend
from kvtier.backends.cpu_tier import CPUTier
from kvtier.backends.segments import Segments
from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.memory import MemoryAllocator
from tests.backends.cpu_ops import LAYOUT, OP, apply_ops, put, unpinned_leaves
from tests.helpers import make_keys

CHUNK_BYTES = LAYOUT.nbytes(16)


def _tier(policy: str, chunks: int = 16) -> tuple[CPUBackend, MemoryAllocator]:
    alloc = MemoryAllocator(chunks * 4096, pin=False)
    cfg = Config(chunk_size=16, max_local_cpu_size=chunks * 4096 / 1e9, eviction_policy=policy)
    cpu = CPUTier(BackendContext(cfg, LAYOUT, alloc))
    assert isinstance(cpu, CPUBackend)
    assert isinstance(cpu, ARCBackend) == (policy == "arc")
    return cpu, alloc


def _evict(cpu: CPUBackend, chunks: int) -> list[str]:
    out = []
    for key, obj in cpu.pop_lru(chunks * CHUNK_BYTES):
        out.append(key.key)
        obj.release()
    return out


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_prefix_that_came_back_outlives_one_off_prompts_under_arc(policy: str) -> None:
    cpu, alloc = _tier(policy)
    p, q, r = (make_keys(4 * 16, layout=LAYOUT, seed=s) for s in (1, 2, 3))
    put(cpu, alloc, p)
    assert _evict(cpu, 4) == [k.key for k in reversed(p)]  # leaf first: a chain from its end
    put(cpu, alloc, p)  # it came back: under arc it joins the main segment
    put(cpu, alloc, q)  # two first-seen prompts, stored after it
    put(cpu, alloc, r)
    gone = _evict(cpu, 2)  # the window (8 chunks) stays over its target (1.6 + 4) meanwhile
    want = p if policy == "lru" else q  # lru takes the least recent; arc the window's
    assert gone == [k.key for k in reversed(want[2:])]
    assert cpu.batch_contains(p) == (2 if policy == "lru" else 4)
    if policy == "arc":
        assert cpu.stats()["window_target_chunks"] > 1.6  # grew: p came back from the window
    cpu.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(OP, max_size=40))
def test_arc_evicts_unpinned_leaves_only(ops) -> None:  # noqa: ANN001
    cpu, alloc = _tier("arc", 64)

    def candidates_exact(tier: CPUBackend) -> None:
        leaves = tier._leaves  # noqa: SLF001
        window, main = set(leaves.window), set(leaves.main_leaves)
        assert window | main == unpinned_leaves(tier) and not window & main

    apply_ops(cpu, alloc, ops, candidates_exact)
    cpu.close()


def test_the_window_target_adapts_to_where_returning_prefixes_were_evicted_from() -> None:
    seg = Segments(100)
    a, b = make_keys(3 * 16, layout=LAYOUT, seed=7), make_keys(2 * 16, layout=LAYOUT, seed=8)
    assert not seg.joins_main(a)  # first seen: the window
    assert seg.joins_main(a)  # seen
    start = seg.target
    seg.evicted(b[0].key, main=False)
    assert seg.joins_main(b) and seg.target == start + 2  # came back from the window: grows
    seg.evicted(b[0].key, main=True)
    assert seg.joins_main(b) and seg.target == start  # from the main segment: shrinks
    assert seg.window_first(int(start) + 1) and not seg.window_first(int(start))


def test_the_eviction_policy_is_a_config_choice() -> None:
    assert Config().eviction_policy == "lfuda"
    with pytest.raises(ConfigError, match="eviction_policy"):
        Config(eviction_policy="mru")
