"""kvtier/demo/quality.py without a server: how two answers are compared."""

from __future__ import annotations

import math

from kvtier.demo.quality import Answer, compare


def _answer(ids: tuple[int, ...], tops: list[dict[int, float]]) -> Answer:
    logprobs = tuple(top[i] for i, top in zip(ids, tops, strict=True))
    return Answer("", ids, logprobs, tops[0], 10, 0, tuple(tops))


def _top(p_first: float) -> dict[int, float]:
    return {1: math.log(p_first), 2: math.log(1 - p_first)}


def test_mean_kl_averages_the_positions_reached_by_the_same_tokens() -> None:
    reference = _answer((1, 1, 1), [_top(0.9), _top(0.9), _top(0.9)])
    assert compare(reference, reference).mean_kl == 0.0
    moved = _answer((1, 1, 1), [_top(0.9), _top(0.6), _top(0.9)])
    got = compare(reference, moved)
    assert got.identical and got.kl == 0.0
    assert math.isclose(got.mean_kl, (0.9 * math.log(1.5) + 0.1 * math.log(0.25)) / 3)
    # after the first differing token the next distributions answer other contexts: left out
    diverged = _answer((2, 1, 1), [_top(0.4), _top(0.01), _top(0.01)])
    first_only = compare(reference, diverged)
    assert not first_only.identical
    assert math.isclose(first_only.mean_kl, first_only.kl)
