"""The predicted-reuse model (`benchmarks.traces.predicted`, issue 69's experiment) on the
checked-in 300-request slices: it stores what it should, stays within the bounds, and its
oracle scoring is what makes Belady's gap: knowing the next use beats LRU."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.traces.bounds import belady, infinite, leaf_lru
from benchmarks.traces.predicted import predicted
from benchmarks.traces.trace import load

DATA = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "data"
VARIANTS = ["last+mean", "ewma+inf+admit", "mean+rate", "ewma+inf+late", "oracle",
            "oracle+noise2"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_cache_holding_the_slice_hits_what_an_unbounded_one_hits(variant: str) -> None:
    requests = load(DATA / "conversation_head300.jsonl")
    # 8,192 blocks hold the slice's 7,814: nothing is evicted, so admission never engages
    # and every variant must store each block once and find it again.
    assert len({b for r in requests for b in r.blocks}) <= 8192
    assert predicted(requests, 8192, variant) == infinite(requests)
    assert predicted(requests, 128, variant) < infinite(requests)


def test_the_oracle_beats_lru_and_stays_under_belady() -> None:
    requests = load(DATA / "synthetic_head300.jsonl")
    blocks = 500_000 // 512
    lru, best = leaf_lru(requests, blocks), belady(requests, blocks)
    oracle = predicted(requests, blocks, "oracle")
    noisy = predicted(requests, blocks, "oracle+noise2")
    assert lru < noisy <= oracle <= best
    assert oracle > 2 * lru  # 2.5x on this slice: the next use is what Belady knows
    assert predicted(requests, blocks, "ewma+inf") == predicted(requests, blocks, "ewma+inf")


def test_an_unknown_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown variant"):
        predicted([], 10, "lfu")
    with pytest.raises(ValueError, match="unknown variant"):
        predicted([], 10, "last+sometimes")
