"""Blend or compute: a blend is chosen only while it is measured to beat the full prefill, and
a planner that saw blends lose still lets one through now and then to see the host quieten."""

from __future__ import annotations

import pytest

from kvtier.blend.planner import BlendPlanner


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_first_blend_runs_unmeasured_then_the_measurement_decides() -> None:
    planner = BlendPlanner(clock=Clock())
    first = planner.choose(1000, prefill_s=2.0)
    assert first.blend and first.reason == "unmeasured" and first.blend_s is None
    planner.observe(1000, 0.6)  # 0.3x the prefill: a quiet host
    quiet = planner.choose(2000, prefill_s=4.0)
    assert quiet.blend and quiet.reason == "faster" and quiet.blend_s == pytest.approx(1.2)
    for _ in range(8):  # a busy host: every blend now takes 1.6x the prefill
        planner.observe(1000, 3.2)
    busy = planner.choose(1000, prefill_s=2.0)
    assert not busy.blend and busy.reason == "slower" and busy.blend_s == pytest.approx(3.2)


def test_the_estimate_is_the_median_so_one_slow_blend_moves_nothing() -> None:
    planner = BlendPlanner(clock=Clock())
    for seconds in (0.5, 0.5, 9.0):  # one blend stalled by a GC pause
        planner.observe(1000, seconds)
    assert planner.choose(1000, prefill_s=1.0).blend


def test_max_ratio_asks_for_a_margin() -> None:
    planner = BlendPlanner(0.5, clock=Clock())
    planner.observe(1000, 0.6)
    assert not planner.choose(1000, prefill_s=1.0).blend  # 0.6x: faster, not twice as fast
    assert planner.choose(1000, prefill_s=1.3).blend
    with pytest.raises(ValueError, match="max_ratio"):
        BlendPlanner(0.0)


def test_while_blends_lose_one_probes_after_the_interval() -> None:
    clock = Clock()
    planner = BlendPlanner(probe_after=3, probe_interval_s=30.0, clock=clock)
    planner.observe(1000, 5.0)
    reasons = [planner.choose(1000, prefill_s=1.0).reason for _ in range(5)]
    assert reasons == ["slower"] * 5  # the last measurement is fresh: no probe yet
    clock.now += 31
    assert planner.choose(1000, prefill_s=1.0).reason == "probe"
    assert planner.choose(1000, prefill_s=1.0).reason == "slower"  # one probe, then wait
    planner.observe(1000, 0.2)  # the probe found a quiet host
    assert planner.choose(1000, prefill_s=1.0).reason == "faster"
