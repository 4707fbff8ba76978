"""The serving benchmark's no-reuse estimators (benchmarks/serving/report.py), on made-up runs."""

from __future__ import annotations

import math

import pytest

from benchmarks.serving.report import calibrated, expected_verify, ratios, same_speed
from benchmarks.serving.shared import RunResult


def _run(duration: float, extend_cpu: float, decode_cpu: float = 2.0,
         forward: bool = True) -> RunResult:
    r = RunResult("pair-kv", 1024, 1, True, "random-ids", duration_s=duration,
                  input_tokens=16_000, cached_tokens=0)
    if forward:  # 20000 extend tokens logged (a warm-up's among them), 16000 the run's
        r.forward = {"extend_count": 17, "extend_tokens": 20_000, "extend_wall_s": 0.0,
                     "extend_cpu_s": extend_cpu, "decode_count": 100, "decode_tokens": 100,
                     "decode_wall_s": 0.0, "decode_cpu_s": decode_cpu}
    return r


def test_same_speed_keeps_each_sides_rest_and_gives_both_one_compute() -> None:
    kv, none = _run(30.0, 20.0), _run(25.0, 18.0)
    got = same_speed(kv, none)
    assert got is not None
    c_kv, c_none = 20.0 * 0.8 + 2.0, 18.0 * 0.8 + 2.0  # CPU per token x the run's tokens
    rest_kv, rest_none = 30.0 - c_kv, 25.0 - c_none
    assert got[0] == pytest.approx((c_none + rest_none) / (c_none + rest_kv))
    assert got[1] == pytest.approx(c_kv / c_none)
    # The same rest on both sides: only the compute differed, so at one speed they are equal.
    assert same_speed(_run(30.0, 20.0), _run(30.0 - 1.6, 18.0))[0] == pytest.approx(1.0)


def test_same_speed_needs_both_forward_logs() -> None:
    assert same_speed(_run(30.0, 20.0, forward=False), _run(25.0, 18.0)) is None
    assert same_speed(_run(30.0, 20.0), _run(25.0, 18.0, forward=False)) is None


def test_calibrated_divides_each_seat_by_its_null_pairs() -> None:
    kv = {"by_core": {0: [0.95, 0.97], 1: [1.00, 1.02]}}
    null = {"by_core": {0: [1.00, 0.98], 1: [1.05, 1.03]}}
    got = calibrated(kv, null)
    assert got is not None

    def geo(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    per = {c: geo(kv["by_core"][c]) / geo(null["by_core"][c]) for c in (0, 1)}
    assert got["per_core"] == pytest.approx({"0": per[0], "1": per[1]})
    assert got["estimate"] == pytest.approx(math.sqrt(per[0] * per[1]))
    low, high = got["ci95"]
    assert low < got["estimate"] < high


def test_calibrated_needs_both_seats_in_both_kinds_of_pair() -> None:
    assert calibrated({"by_core": {0: [0.95]}}, {"by_core": {0: [1.0], 1: [1.0]}}) is None


def _rate(phase: str, length: int, rate: float) -> RunResult:
    return RunResult(phase, length, 1, phase != "none", "generated-shared-prefix",
                     request_throughput=rate)


def test_expected_verify_charges_a_miss_for_each_verified_hit() -> None:
    # A miss costs 1/2 s, a hit 1/10 s: verifying 1% adds 0.01 x 0.4 s to 0.1 s per request.
    runs = [_rate("none", 1024, 2.0), _rate("second", 1024, 10.0), _rate("second", 1024, 9.0),
            _rate("second", 1024, 11.0), _rate("none", 2048, 1.0)]
    got = expected_verify(runs, 0.01)
    assert got == {1024: pytest.approx(0.1 / (0.1 + 0.01 * 0.4))}
    assert expected_verify(runs, 0.0)[1024] == pytest.approx(1.0)


def test_verify_ratio_is_second_verify_over_second() -> None:
    runs = [_rate("second", 1024, 10.0), _rate("second-verify", 1024, 9.7)]
    got = ratios(runs)
    entry = next(v for k, v in got.items() if k.startswith("request throughput, second"))
    assert entry["median"] == pytest.approx(0.97)
    assert entry["held"] == 0 and entry["bound"] == ">= 0.98x"
