"""The serving benchmark's timeline: what a server spent inside the client's measured window."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from benchmarks.serving.timeline import GROUPS, Sampler, forward_totals, in_window


def _row(t: float, engine: float, kvtier: float, writes: float = 0.0) -> list[float]:
    return [t, engine, kvtier, 0.0, 0.0, writes]


def test_the_window_is_interpolated_between_samples() -> None:
    rows = [_row(100.0, 0.0, 0.0), _row(101.0, 1.0, 0.5, 4), _row(102.0, 2.0, 0.5, 10)]
    got = in_window(rows, 100.5, 101.5)
    assert got is not None
    assert got["engine"] == pytest.approx(1.0)
    assert got["kvtier"] == pytest.approx(0.25)  # half of the first second's 0.5
    assert got["writes"] == pytest.approx(5.0)  # 2 of the first second's 4, 3 of the next 6
    assert set(got) == set(GROUPS)


def test_a_window_the_samples_do_not_cover_is_none() -> None:
    rows = [_row(100.0, 0.0, 0.0), _row(101.0, 1.0, 0.0)]
    assert in_window(rows, 99.0, 100.5) is None
    assert in_window(rows, 100.5, 101.5) is None
    assert in_window(rows[:1], 100.0, 100.0) is None


def test_the_sampler_reads_every_run_until_stopped() -> None:
    calls = {"a": 0, "b": 0}
    enough = threading.Event()

    def cpu(name: str) -> dict[str, float]:
        calls[name] += 1
        if min(calls.values()) >= 3:
            enough.set()
        return {"sglang::scheduler*": float(calls[name]), "kv-writer-redis": 0.5,
                "redis-server*": 0.25}

    def failing() -> float:
        raise OSError("endpoint gone")

    sampler = Sampler([lambda: cpu("a"), lambda: cpu("b")], [None, failing], period=0.01)
    sampler.start()
    assert enough.wait(10)
    sampler.stop()
    first, second = sampler.rows
    assert len(first) >= 3 and second == []  # a failed read skips that run's sample
    assert first[0][1:] == [1.0, 0.5, 0.25, 0.0, 0.0]
    assert [row[0] for row in first] == sorted(row[0] for row in first)


def test_forward_totals_count_the_forwards_inside_the_window(tmp_path: Path) -> None:
    log = tmp_path / "server.forward"
    log.write_text("99.000 extend 1000 1.5 1.2\n"  # before the window
                   "100.500 extend 1600 2.0 1.8\n"
                   "100.600 decode 2 0.030 0.028\n"
                   "101.000 decode 1 0.020 0.020\n"
                   "102.000 extend 900 1.0 1.0\n")  # after it
    got = forward_totals(log, 100.0, 101.0)
    assert got is not None
    assert (got["extend_count"], got["extend_tokens"]) == (1, 1600)
    assert (got["extend_wall_s"], got["extend_cpu_s"]) == (2.0, 1.8)
    assert (got["decode_count"], got["decode_tokens"]) == (2, 3)
    assert got["decode_wall_s"] == pytest.approx(0.05)
    assert forward_totals(tmp_path / "absent", 100.0, 101.0) is None
