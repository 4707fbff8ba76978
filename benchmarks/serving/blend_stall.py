"""bench_blend's `--engine sglang --stall`: does a blended admission stall the streams running
beside it? (issue 75: a stream's worst inter-token gap beside a blended admission at most 5x
its median.)

The retrieval workload and server of `blend_sglang` (SmolLM2 in float32, the README's CPU
line, documents stored by a warm-up). Per query and arm, after `/flush_cache`: a stream starts
(`--stream-tokens` greedy tokens of an unrelated prompt), and once it has produced
`WARM_TOKENS` tokens the query is sent, as a `full` request (opted out of blending: SGLang
computes it) or a `blend` one. Measured: the stream's median gap before the query, the median,
p99 and worst of its gaps while the query waits for its first token, and the query's TTFT. The
ratio worst/median is what a user of the running stream sees; the same run's `full` arm is the
baseline. Whether the blend arm blended (its log line; the planner may compute it instead) is
kept per query, and `worst_over_median_blended` is the worst ratio beside a blended admission.
kvtier's slow scheduler-thread calls (its rate-limited log lines, over 50 ms) are listed.
"""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.serving.adaptive_report import p99
from benchmarks.serving.blend_sglang import _warm, generate, server_for
from kvtier.demo.server import SGLangServer

__all__ = ["run_stall"]

WARM_TOKENS = 20  # stream tokens before the query: the stream's median gap is taken on these
BLEND_LINE = "kvtier: blended "  # the blend's log line, one per blended request


def _beside(server: SGLangServer, stream_ids: list[int], ids: list[int], tokens: int,
            full: bool) -> dict[str, float]:
    """One query sent while a stream runs: the stream's gaps, the query's TTFT."""
    times: list[float] = []
    streamer = threading.Thread(target=server.stream_generate, args=(stream_ids, tokens),
                                kwargs={"on_chunk": lambda: times.append(time.monotonic())})
    streamer.start()
    deadline = time.monotonic() + 300  # a bound on a hang
    while len(times) < WARM_TOKENS and time.monotonic() < deadline:
        time.sleep(0.005)
    sent = time.monotonic()
    _, ttft = generate(server, ids, 1, full=full, salt=f"full-{sent}" if full else None)
    answered = sent + ttft
    streamer.join()
    before = [b - a for a, b in zip(times[2:], times[3:]) if b <= sent]
    during = [b - a for a, b in zip(times, times[1:]) if b >= sent and a <= answered]
    if not before or not during or times[-1] < answered:
        raise RuntimeError(f"the stream ({tokens} tokens) ended before the query's first token "
                           f"({ttft:.1f} s): raise --stream-tokens")
    median = statistics.median(before)
    return {"ttft_s": ttft, "median_gap_ms": median * 1e3,
            "during_median_gap_ms": statistics.median(during) * 1e3,
            "p99_gap_ms": p99(during) * 1e3, "worst_gap_ms": max(during) * 1e3,
            "worst_over_median": max(during) / median}


SLOW = re.compile(r"kvtier: (\S+) took (\d+) ms on SGLang's scheduler thread \(request")


def slow_calls(log: str) -> list[tuple[str, int]]:
    """kvtier's calls on the scheduler thread that the server logged as slow (over 50 ms,
    while a request was in flight; rate-limited per call: a lower bound on how many)."""
    return [(name, int(ms)) for name, ms in SLOW.findall(log)]


def run_stall(args: argparse.Namespace, model: Path, docs: list[list[int]],
              queries: list[list[int]], sep: list[int], system: list[int], ask: list[int],
              work: Path, separator: str) -> dict[str, Any]:
    """The summary: per arm, the stream's worst/median gap (median and p99 over queries) and
    the query's TTFT, blend over full."""
    server = server_for(model, work, args, separator)
    server.start()
    stream_ids = (system * 8)[:64]
    rows: list[dict[str, Any]] = []
    try:
        _warm(server, docs, sep, system, ask)
        for q, ids in enumerate(queries):
            row: dict[str, Any] = {"tokens": len(ids)}
            for arm in ("full", "blend"):
                server.flush_cache()
                blends = server.log().count(BLEND_LINE)
                row[arm] = _beside(server, stream_ids, ids, args.stream_tokens, arm == "full")
            row["blended"] = server.log().count(BLEND_LINE) > blends  # else computed
            row["fallback"] = server.log().count("computed, not blended: a blend of")
            rows.append(row)
            f, b = row["full"], row["blend"]
            print(f"query {q}: {len(ids)} tokens; stream gaps beside it (median before, median, "
                  f"p99, max during; max/median): full {f['median_gap_ms']:.0f}, "
                  f"{f['during_median_gap_ms']:.0f}, {f['p99_gap_ms']:.0f}, "
                  f"{f['worst_gap_ms']:.0f} ms, {f['worst_over_median']:.1f}x; "
                  f"{'blend' if row['blended'] else 'blend arm (computed)'} "
                  f"{b['median_gap_ms']:.0f}, {b['during_median_gap_ms']:.0f}, "
                  f"{b['p99_gap_ms']:.0f}, {b['worst_gap_ms']:.0f} ms, "
                  f"{b['worst_over_median']:.1f}x; TTFT full {f['ttft_s']:.2f}s, blend "
                  f"{b['ttft_s']:.2f}s", flush=True)
        slow = slow_calls(server.log())
    finally:
        server.stop()
    out: dict[str, Any] = {"engine": "sglang", "stall": True, "args": vars(args), "rows": rows,
                           "fallbacks": rows[-1]["fallback"] if rows else 0,
                           "blended": sum(r["blended"] for r in rows),
                           "slow_calls": slow, "slowest_call_ms": max((ms for _, ms in slow),
                                                                      default=0)}
    for arm in ("full", "blend"):
        ratios = [r[arm]["worst_over_median"] for r in rows]
        out[f"worst_over_median_{arm}"] = statistics.median(ratios)
        out[f"worst_over_median_{arm}_p99"] = p99(ratios)
        for key in ("median_gap_ms", "p99_gap_ms", "worst_gap_ms"):
            out[f"{key}_{arm}"] = statistics.median(r[arm][key] for r in rows)
    blended = [r["blend"]["worst_over_median"] for r in rows if r["blended"]]
    out["worst_over_median_blended"] = max(blended, default=None)  # the bound: 5x
    ttft = [r["blend"]["ttft_s"] / r["full"]["ttft_s"] for r in rows]
    out["ttft_ratio"], out["ttft_ratio_p99"] = statistics.median(ttft), p99(ttft)
    return out
