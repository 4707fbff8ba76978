"""kvtier's tier events name SGLang's own block hashes: the device events SGLang's recorder
makes for a prompt, and the events of the chunks kvtier's tiers store for it, carry the same
hashes and parent links, salted or not, at every page size; removals name them again; the
queue is bounded and what it drops is counted."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvtier.integration.sglang.rank.tier_events import TierEvents
from kvtier.keys import ChunkKey, KeyBuilder
from kvtier.metrics import Counters

pytestmark = pytest.mark.sglang

CHUNK = 32


@pytest.fixture(scope="module")
def sglang_events() -> Any:
    from sglang.srt.mem_cache import events, radix_cache

    return events, radix_cache


BUILDER = KeyBuilder(model="m", fingerprint="f", chunk_size=CHUNK)


def _keys(tokens: np.ndarray, salt: str = "", segment: bool = False) -> list[ChunkKey]:
    return list(BUILDER.chain(tokens, salt, segment=segment))


def _device_events(sglang: Any, tokens: np.ndarray, page: int, salt: str) -> list[Any]:
    """What SGLang publishes when its device tree inserts `tokens` under the root."""
    events, radix_cache = sglang
    recorder = events.KVCacheEventRecorder(enabled=True, page_size=page)
    root = radix_cache.TreeNode()
    root.key, root.hash_value = radix_cache.RadixKey([], cache_salt=salt or None), []
    node = radix_cache.TreeNode()
    node.parent = root
    node.key = radix_cache.RadixKey(tokens.tolist(), cache_salt=salt or None)
    recorder.record_store(node)
    return recorder.take()


def _tier_events(sglang: Any, page: int, **kw: int) -> tuple[TierEvents, Counters]:
    counters = Counters()
    return TierEvents(page, counters, starts_prefix=BUILDER.starts_prefix, **kw), counters


def _hashes(events: list[Any]) -> list[int]:
    return [h for event in events for h in event.block_hashes]


@pytest.mark.parametrize("salt", ["", "tenant-a"])
@pytest.mark.parametrize("page", [1, 16, 32])
def test_a_stored_prompt_names_the_device_s_block_hashes(sglang_events: Any, page: int,
                                                        salt: str) -> None:
    tokens = np.random.default_rng(page).integers(0, 50_000, 4 * CHUNK)
    device = _device_events(sglang_events, tokens, page, salt)
    tiers, counters = _tier_events(sglang_events, page)
    keys = _keys(tokens, salt)
    tiers.stored("cpu", keys)
    tiers.stored("disk", keys[:2])
    cpu, disk = tiers.take(), tiers.take()
    assert disk == []  # one take returns everything queued
    stored = [e for e in cpu if e.medium == "CPU_PINNED"]
    assert _hashes(stored) == _hashes(device) and len(_hashes(device)) == 4 * CHUNK // page
    # each chunk's first page links to the previous chunk's last, as the device's pages do
    parents = [e.parent_block_hash for e in stored]
    assert parents[0] is None and parents[1:] == [e.block_hashes[-1] for e in stored[:-1]]
    assert all(e.cache_salt == (salt or None) for e in stored)
    on_disk = [e for e in cpu if e.medium == "DISK"]
    assert _hashes(on_disk) == _hashes(device)[:2 * CHUNK // page]
    assert on_disk[1].parent_block_hash == on_disk[0].block_hashes[-1]
    assert on_disk[0].token_ids == tokens[:CHUNK].tolist()
    assert counters.snapshot()["sglang.tier_events"] == len(cpu)


def test_an_eviction_names_the_evicted_chunks_blocks(sglang_events: Any) -> None:
    tokens = np.arange(3 * CHUNK) + 7
    tiers, _ = _tier_events(sglang_events, 16)
    keys = _keys(tokens)
    tiers.stored("cpu", keys)
    stored = _hashes(tiers.take())
    tiers.removed("cpu", [k.key for k in keys[1:]])
    (removed,) = tiers.take()
    assert removed.medium == "CPU_PINNED" and removed.block_hashes == stored[2:]


def test_a_chunk_whose_prefix_was_never_announced_is_counted_not_guessed(
        sglang_events: Any) -> None:
    tiers, counters = _tier_events(sglang_events, 16)
    keys = _keys(np.arange(2 * CHUNK))
    tiers.stored("redis", keys[1:])  # its first chunk never seen: no parent hash to chain to
    assert tiers.take() == []
    assert counters.snapshot()["sglang.tier_events_unchained"] == 1
    tiers.stored("redis", keys)
    assert [e.medium for e in tiers.take()] == ["EXTERNAL", "EXTERNAL"]


def test_the_queue_is_bounded_and_counts_what_it_drops(sglang_events: Any) -> None:
    tiers, counters = _tier_events(sglang_events, 16, max_events=3)
    tiers.stored("cpu", _keys(np.arange(5 * CHUNK)))
    assert len(tiers.take()) == 3
    assert counters.snapshot()["sglang.tier_events_dropped"] == 2
    tiers.stored("cpu", _keys(np.arange(CHUNK) + 9))  # room again after a take
    assert len(tiers.take()) == 1


def test_tiers_without_a_medium_publish_nothing(sglang_events: Any) -> None:
    tiers, _ = _tier_events(sglang_events, 16)
    tiers.stored("plugin-tier", _keys(np.arange(CHUNK)))
    assert tiers.take() == []


@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_a_blending_segment_is_no_prefix_and_is_not_announced(sglang_events: Any,
                                                             salt: str) -> None:
    """A segment's chunks are cached as if the segment were a whole prompt, under a root of
    their own: no request's prefix lookup finds them, so a router must not be told they are
    there."""
    tiers, counters = _tier_events(sglang_events, 16)
    tokens = np.arange(2 * CHUNK) + 5
    tiers.stored("cpu", _keys(tokens, salt, segment=True))
    assert tiers.take() == []
    assert counters.snapshot()["sglang.tier_events_unchained"] == 2
    tiers.stored("cpu", _keys(tokens, salt))  # the same tokens as a prompt's prefix
    assert len(_hashes(tiers.take())) == 2 * CHUNK // 16
