"""The disk tier under `eviction_policy: lfuda` (kvtier/backends/disk/frequency.py): a prefix
used often outlives a stream of one-off writes, a prefix is never holed where the tier wrote its
chain, the share per tenant still goes first; against `lru` on the same writes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.backends import BackendContext
from kvtier.backends.disk import DiskBackend
from kvtier.backends.disk.index import DiskIndex
from kvtier.config import Config
from kvtier.config.names import LFUDA, LRU
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, lease
from tests.backends.disk.disk_helpers import CHUNK, _put
from tests.helpers import SMALL_MHA, make_keys

RECORDS = 12  # the cap, in records of one chunk


@pytest.fixture
def open_tier(tmp_path: Path, arena: MemoryAllocator) -> Iterator:
    opened: list[DiskBackend] = []

    def _open(policy: str) -> DiskBackend:
        probe = DiskBackend(_ctx(tmp_path / "probe", 1.0, policy, arena))
        _put(probe, make_keys(CHUNK, seed=999), arena)
        record = int(probe.stats()["bytes"])
        probe.close()
        tier = DiskBackend(_ctx(tmp_path / policy, RECORDS * record / 1e9, policy, arena))
        opened.append(tier)
        return tier

    yield _open
    for tier in opened:
        tier.check_integrity()
        tier.close()


def _ctx(root: Path, cap_gb: float, policy: str, arena: MemoryAllocator) -> BackendContext:
    config = Config(chunk_size=CHUNK, max_local_cpu_size=0.016, max_local_disk_size=cap_gb,
                    local_disk=str(root), eviction_policy=policy)
    return BackendContext(config=config, layout=SMALL_MHA, allocator=arena)


def _held(tier: DiskBackend, keys: list[ChunkKey]) -> list[bool]:
    """Which of `keys` have a record file (read from the directory, not the index)."""
    return [tier.path_for(k.key).exists() for k in keys]


def _read(tier: DiskBackend, keys: list[ChunkKey]) -> int:
    with lease(tier.batch_get(keys)) as got:
        return len(got)


@pytest.mark.parametrize("policy", [LRU, LFUDA])
def test_a_prefix_used_often_outlives_one_off_writes_under_lfuda_only(open_tier, arena,
                                                                      policy: str) -> None:
    tier = open_tier(policy)
    hot = make_keys(2 * CHUNK, seed=1)
    _put(tier, hot, arena)
    for _ in range(6):  # read from disk, and hit in the CPU tier above it
        assert _read(tier, hot) == 2
        tier.touch(hot)
    for seed in range(100, 100 + 3 * RECORDS // 2):  # three times the cap, each prompt once
        _put(tier, make_keys(2 * CHUNK, seed=seed), arena)
    assert tier.stats()["evictions"] >= 2 * RECORDS
    if policy == LFUDA:
        assert _read(tier, hot) == 2
    else:
        assert _held(tier, hot) == [False, False]


@pytest.mark.parametrize("policy", [LRU, LFUDA])
def test_a_prefix_written_in_two_stores_is_never_holed_under_lfuda(open_tier, arena,
                                                                   policy: str) -> None:
    # Each prompt's first chunk is written, then its second after other prompts' writes: the
    # parent is older than its child. LRU evicts the parent first (the child stays, unreadable).
    tier = open_tier(policy)
    prompts = [make_keys(2 * CHUNK, seed=seed) for seed in range(40)]
    _put(tier, prompts[0][:1], arena)
    for before, keys in zip(prompts, prompts[1:], strict=False):
        _put(tier, keys[:1], arena)
        _put(tier, before[1:], arena)
    holed = [keys for keys in prompts if _held(tier, keys) == [False, True]]
    if policy == LFUDA:
        assert holed == []
        held = tier.stats()["entries"]
        assert held >= RECORDS - 1 and sum(_read(tier, keys) for keys in prompts) == held
    else:
        assert holed  # what lfuda's chain prevents


def _lfuda_index(capacity: int, *records: tuple[str, str | None]) -> DiskIndex:
    """An lfuda index of 10-byte records (name, parent), this tier's own."""
    index = DiskIndex(capacity, policy=LFUDA)
    index.claim("ns/m")
    for name, parent in records:
        index.put(name, 10, "ns/m", parent)
    return index


def test_a_parent_goes_after_its_child_in_one_pick_and_never_past_a_pinned_child() -> None:
    index = _lfuda_index(40, ("a", None), ("b", "a"), ("c", "b"), ("x", None))
    index.touch(["x"])  # x: two uses; a, b, c: one each, c the only leaf of its chain
    assert index.victims(10) == ["c"]
    assert index.victims(30, shrink=4) == ["c", "b", "a"]  # a chain from its end
    index.pin("c")  # being read: its prefix stays too
    assert index.victims(30, shrink=4) is None
    assert index.victims(10, shrink=4) == ["x"]
    index.unpin("c")
    index.forget("c", evicted=True)
    assert index.victims(20) == ["b"]  # 30 held: a leaf now, of fewer uses than x
    index.check()


def test_the_share_per_tenant_still_goes_first_under_lfuda() -> None:
    index = DiskIndex(100, share=0.5, policy=LFUDA)
    index.claim("ns/m")
    for i in range(4):  # the noisy tenant's records, each used three times
        index.put(f"n{i}", 20, "ns/m\0noisy")
        index.touch([f"n{i}"])
        index.touch([f"n{i}"])
    index.put("q", 20, "ns/m\0quiet")  # the quiet tenant's, used once: lfuda alone takes it
    assert index.victims(20) == ["n0"]  # the noisy tenant is over half the cap
    index.check()
