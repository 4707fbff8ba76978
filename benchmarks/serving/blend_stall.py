"""bench_blend's `--engine sglang --stall`: does a blended admission stall the streams running
beside it? (issue 75: a stream's worst inter-token gap beside a blended admission at most 5x
its median.)

The retrieval workload and server of `blend_sglang` (SmolLM2 in float32, the README's CPU
line, documents stored by a warm-up). Per query and arm, after `/flush_cache`: a stream starts
(`--stream-tokens` greedy tokens of an unrelated prompt), and once it has produced
`WARM_TOKENS` tokens the query is sent, as a `full` request (opted out of blending: SGLang
computes it) or a `blend` one. Measured: the stream's median gap before the query, its worst
gap while the query waits for its first token, and the query's TTFT. The ratio worst/median is
what a user of the running stream sees; the same run's `full` arm is the baseline.
"""

from __future__ import annotations

import argparse
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
            "worst_gap_ms": max(during) * 1e3, "worst_over_median": max(during) / median}


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
                row[arm] = _beside(server, stream_ids, ids, args.stream_tokens, arm == "full")
            row["fallback"] = server.log().count("computed, not blended: a blend of")
            rows.append(row)
            print(f"query {q}: {len(ids)} tokens; stream worst/median gap: full "
                  f"{row['full']['worst_over_median']:.1f}x, blend "
                  f"{row['blend']['worst_over_median']:.1f}x; TTFT full "
                  f"{row['full']['ttft_s']:.2f}s, blend {row['blend']['ttft_s']:.2f}s",
                  flush=True)
    finally:
        server.stop()
    out: dict[str, Any] = {"engine": "sglang", "stall": True, "args": vars(args), "rows": rows,
                           "fallbacks": rows[-1]["fallback"] if rows else 0}
    for arm in ("full", "blend"):
        ratios = [r[arm]["worst_over_median"] for r in rows]
        out[f"worst_over_median_{arm}"] = statistics.median(ratios)
        out[f"worst_over_median_{arm}_p99"] = p99(ratios)
    ttft = [r["blend"]["ttft_s"] / r["full"]["ttft_s"] for r in rows]
    out["ttft_ratio"], out["ttft_ratio_p99"] = statistics.median(ttft), p99(ttft)
    return out
