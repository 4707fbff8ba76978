"""The trace replay on the checked-in slices (the first 300 requests of Mooncake's two traces):
kvtier's CPU tier against the plain-Python LRU that copies its rules, Belady's bound, the
infinite cache, and the command's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.traces.bounds import belady, infinite, leaf_lru
from benchmarks.traces.replay import replay, run
from benchmarks.traces.trace import BLOCK, Request, load

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "benchmarks" / "traces" / "data"
SLICES = sorted(DATA.glob("*_head300.jsonl"))
CAPACITIES = [10_000, 100_000, 500_000, 2_000_000]  # 19 to 3906 blocks: the slices hold ~8k


def test_the_slices_are_checked_in_with_their_license() -> None:
    assert [p.name for p in SLICES] == ["conversation_head300.jsonl", "synthetic_head300.jsonl"]
    assert "Apache License" in (DATA / "LICENSE-APACHE").read_text()
    assert all(len(load(p)) == 300 for p in SLICES)


@pytest.mark.parametrize("trace", SLICES, ids=lambda p: p.name.split("_")[0])
def test_kvtier_matches_its_lru_and_stays_within_the_bounds(trace: Path) -> None:
    result = run(trace, CAPACITIES)
    assert result["requests"] == 300
    assert result["input_tokens"] == sum(r.input_length for r in load(trace))
    top = result["infinite_hit_rate"]
    assert 0 < top < 1
    rates = []
    for row in result["runs"]:
        # The CPU tier is LRU over leaves; the plain model copies its rules step for step,
        # so the two agree to the token, evictions of requests longer than the cache included.
        assert row["hit_rate"] == row["lru_hit_rate"]
        assert 0 < row["hit_rate"] <= row["belady_hit_rate"] <= top
        cpu = row["tiers"]["cpu"]
        assert cpu["stored_chunks"] == row["chunks_put"] > 0
        assert cpu["bytes_written"] == cpu["stored_chunks"] * 4096
        assert cpu["hit_chunks"] * BLOCK >= row["hit_tokens"]
        rates.append((row["hit_rate"], row["belady_hit_rate"]))
    assert rates == sorted(rates)  # a larger cache never hits less, under either policy
    assert result["runs"][0]["tiers"]["cpu"]["evicted_chunks"] > 0
    assert result["runs"][-1]["belady_hit_rate"] == pytest.approx(top)  # holds the slice


def test_a_disk_tier_serves_what_the_cpu_tier_evicted() -> None:
    requests = load(SLICES[0])
    alone = replay(requests, 10_000)
    both = replay(requests, 10_000, disk_tokens=1_000_000)
    disk = both["tiers"]["disk"]
    # Write-through: every put is offered to the disk (a writer skips a chunk whose prefix
    # is no longer there to reach it).
    assert disk["hit_chunks"] > 0 and 0.95 * both["chunks_put"] < disk["stored_chunks"] \
        <= both["chunks_put"]
    assert disk["bytes_written"] > disk["stored_chunks"] * 4096  # records carry headers
    assert disk["evicted_chunks"] > 0  # 1953 records' worth of disk for ~8k chunks
    assert disk["writes_lost"] == both["stats"]["disk.writes_lost"] >= 0
    assert alone["hit_rate"] < both["hit_rate"] <= infinite(requests) / 4269971


def _req(*blocks: int) -> Request:
    return Request(len(blocks) * BLOCK, blocks)


def test_belady_declines_to_store_what_comes_back_last_and_lru_does_not() -> None:
    trace = [_req(1, 2), _req(3), _req(1, 2), _req(3)]
    assert infinite(trace) == 3 * BLOCK
    assert belady(trace, 2) == 2 * BLOCK  # keeps 1, 2: the third request hits both
    assert leaf_lru(trace, 2) == BLOCK  # 3 evicted the leaf 2: the third hits 1 only


def test_lru_takes_a_chain_from_its_end_before_touching_another() -> None:
    # 1-2 and 5 are stored; 6 evicts leaf 2 (least recent); the parent 1 becomes a leaf and is
    # taken next, before 5, so 7 leaves 5 and 6 cached.
    trace = [_req(1, 2), _req(5), _req(6), _req(7), _req(5), _req(1)]
    assert leaf_lru(trace, 3) == BLOCK  # 5 hits, 1 misses
    assert belady(trace, 3) == 2 * BLOCK


def test_a_hit_is_capped_at_the_input_length() -> None:
    trace = [Request(600, (1, 2)), Request(700, (1, 2))]
    assert infinite(trace) == 700 and leaf_lru(trace, 2) == 700 and belady(trace, 2) == 700


def test_the_command_writes_the_json_the_issue_names(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/traces/replay.py", "--trace", str(SLICES[1]),
         "--capacity-tokens", "1e4,1e5", "--limit", "120", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120, check=True)
    data = json.loads(out.read_text())
    assert data["requests"] == 120 and data["input_tokens"] > 0
    assert 0 <= data["infinite_hit_rate"] <= 1
    assert [r["capacity_tokens"] for r in data["runs"]] == [10_000, 100_000]
    for row in data["runs"]:
        assert row["policy"] == "lru" and 0 <= row["hit_rate"] <= data["infinite_hit_rate"]
        assert set(row["tiers"]["cpu"]) == {"hit_chunks", "stored_chunks", "evicted_chunks",
                                            "bytes_written"}
    assert "kvtier/Belady" in proc.stdout and "no capacity limit" in proc.stdout


def test_each_policy_is_replayed_at_each_capacity_and_second_hit_refuses_one_offs() -> None:
    result = run(SLICES[0], [10_000, 500_000], "lru,arc,lru+second_hit")
    rows = {(r["capacity_tokens"], r["policy"]): r for r in result["runs"]}
    assert [(r["capacity_tokens"], r["policy"]) for r in result["runs"]] == [
        (c, p) for c in (10_000, 500_000) for p in ("lru", "arc", "lru+second_hit")]
    for cap in (10_000, 500_000):
        lru, arc, gated = (rows[cap, p] for p in ("lru", "arc", "lru+second_hit"))
        assert lru["hit_rate"] == lru["lru_hit_rate"]  # the bounds belong to the capacity
        assert arc["lru_hit_rate"] == lru["lru_hit_rate"]
        assert 0 <= arc["stats"]["cpu.window_target_chunks"] <= cap // BLOCK
        # On this slice most chains are seen once: refused, and the few that come back hit.
        assert gated["stats"]["admission_refused_chunks"] > 0
        assert gated["chunks_put"] < lru["chunks_put"]
        assert gated["hit_rate"] > lru["hit_rate"]
    with pytest.raises(ValueError, match="unknown policy 'mru'"):
        run(SLICES[0], [10_000], "lru,mru", limit=5)


def test_lfuda_keeps_a_reused_prefix_through_one_off_bursts_that_lru_lets_go() -> None:
    # A 4-block prefix asked for twice, then every third request, two one-off 6-block prompts
    # between: 12 new blocks between its uses, in a cache of 10 blocks.
    hot = Request(4 * BLOCK, (1, 2, 3, 4))
    requests = [hot]
    for i in range(30):
        requests.append(hot)
        requests += [Request(6 * BLOCK, tuple(range(100 + 12 * i + 6 * j, 106 + 12 * i + 6 * j)))
                     for j in (0, 1)]
    rows = {p: replay(requests, 10 * BLOCK, p) for p in ("lru", "lfuda")}
    assert rows["lru"]["hit_tokens"] == 4 * BLOCK  # the second use only: then always evicted
    assert rows["lfuda"]["hit_tokens"] == 30 * 4 * BLOCK  # every use but the first
    assert rows["lfuda"]["tiers"]["cpu"]["evicted_chunks"] > 0


@pytest.mark.parametrize("trace", SLICES, ids=lambda p: p.name.split("_")[0])
def test_lfuda_stays_within_the_bounds_on_the_slices(trace: Path) -> None:
    # 300 requests are too few for counts to tell: lfuda is LRU's equal here at the two small
    # capacities and 0.85-0.99x of it at the larger (the full traces: docs/policies.md).
    result = run(trace, CAPACITIES, "lru,lfuda")
    rows = {(r["capacity_tokens"], r["policy"]): r for r in result["runs"]}
    for cap in CAPACITIES:
        lru, lfuda = rows[cap, "lru"], rows[cap, "lfuda"]
        assert lfuda["tiers"]["cpu"]["evicted_chunks"] > 0  # the policy had to choose
        assert 0.8 * lru["hit_rate"] < lfuda["hit_rate"] <= lfuda["belady_hit_rate"]
