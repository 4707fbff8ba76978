"""bench_blend's plain arm (prompts without segments, blending on against off): the prompts
carry no separator, and the summary is the ratios of what the two servers measured."""

from __future__ import annotations

import pytest

from benchmarks.serving.blend_plain import plain_prompts, summarize_plain


def test_plain_prompts_replace_every_separator_and_refuse_a_joiner_holding_it() -> None:
    queries = [[1, 9, 2, 3, 9, 4], [9, 5]]
    assert plain_prompts(queries, [9], [7]) == [[1, 7, 2, 3, 7, 4], [7, 5]]
    assert plain_prompts(queries, [9], [7, 8]) == [[1, 7, 8, 2, 3, 7, 8, 4], [7, 8, 5]]
    with pytest.raises(ValueError, match="joiner"):
        plain_prompts(queries, [9], [7, 9])


def _row(off_miss: float, on_miss: float, off_hit: float, on_hit: float, identical: bool,
         kl: float) -> dict[str, object]:
    return {"off_miss_s": off_miss, "on_miss_s": on_miss, "off_hit_s": off_hit,
            "on_hit_s": on_hit, "identical": identical, "kl": kl}


def test_the_summary_is_on_over_off_per_query_then_the_median() -> None:
    rows = [_row(4.0, 4.4, 1.0, 1.0, True, 0.0), _row(5.0, 4.5, 2.0, 1.0, True, 0.0),
            _row(2.0, 2.0, 1.0, 1.5, False, 0.03)]
    s = summarize_plain(rows, blended=0)
    assert s["plain_miss_ratio"] == pytest.approx(1.0)  # of 1.1, 0.9, 1.0
    assert s["plain_miss_ratio_min"] == pytest.approx(0.9)
    assert s["plain_hit_ratio"] == pytest.approx(1.0)  # of 1.0, 0.5, 1.5
    assert s["plain_hit_ratio_p99"] == pytest.approx(1.5, abs=0.02)
    assert s["off_miss_median_s"] == 4.0 and s["on_hit_median_s"] == 1.0
    assert s["plain_identical"] == pytest.approx(2 / 3)
    assert s["plain_kl"] == pytest.approx(0.01)
    assert s["blended"] == 0 and s["rows"] is rows
