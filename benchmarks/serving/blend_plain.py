"""bench_blend's `--engine sglang --plain`: prompts without segments on two real SGLang servers
with kvtier, one with `enable_blending` and one without (the same config otherwise), so that
what blending costs a prompt it cannot blend is measured: nothing should change.

The prompts are the retrieval workload's with the documents joined by a newline instead of the
separator, so no segment is found. Both servers run side by side; per query the order of the
two alternates (off first on even queries), which cancels a drift of the host between them.
Per query and server, each as a one-token request timed by its wall time:
    miss     the prompt under a `cache_salt` of its own, after `/flush_cache`: every token
             computed
    hit      the same again after `/flush_cache`: the prefix loaded from kvtier's CPU tier
then the `--answer-tokens` greedy answer, compared across the two servers
(`kvtier.demo.quality.compare`: identical tokens, log-probabilities, first-token KL).
`--on-first` starts the blending server first (the host may favour one position).
`--null`: both servers without blending, the same run otherwise: the spread two equal servers
show on this host, which a difference must exceed to count.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from benchmarks.serving.adaptive_report import p99
from benchmarks.serving.blend_sglang import BLENDED, generate, server_for
from kvtier.demo.quality import Answer, compare
from kvtier.demo.server import SGLangServer

__all__ = ["plain_prompts", "run_plain", "summarize_plain"]

ARMS = ("off", "on")


def plain_prompts(queries: list[list[int]], sep: list[int], joiner: list[int]
                  ) -> list[list[int]]:
    """`queries` with every separator token replaced by `joiner`: prompts without segments."""
    (sep_id,) = sep
    out = [[t for s in q for t in (joiner if s == sep_id else [s])] for q in queries]
    if any(sep_id in q for q in out):
        raise ValueError(f"joiner {joiner} holds the separator token {sep_id}")
    return out


def _query(servers: dict[str, SGLangServer], q: int, ids: list[int], answer_tokens: int
           ) -> dict[str, Any]:
    row: dict[str, Any] = {"tokens": len(ids)}
    order = ARMS if q % 2 == 0 else ARMS[::-1]
    for arm in order:
        server, salt = servers[arm], f"plain-{q}"  # a salt per query: its first request misses
        server.flush_cache()
        _, row[f"{arm}_miss_s"] = generate(server, ids, 1, full=False, salt=salt)
        server.flush_cache()
        out, row[f"{arm}_hit_s"] = generate(server, ids, 1, full=False, salt=salt)
        row[f"{arm}_cached"] = int(out["meta_info"].get("cached_tokens", 0))
        row[arm] = Answer.from_response(generate(server, ids, answer_tokens, full=False,
                                                 salt=salt)[0])
    agreement = compare(row["off"], row["on"])
    row["identical"], row["kl"] = agreement.identical, agreement.kl
    del row["off"], row["on"]
    return row


def summarize_plain(rows: list[dict[str, Any]], blended: int) -> dict[str, Any]:
    """The JSON of a plain run: blending on over off, miss and hit TTFT (median, p99 of the
    per-query ratios), identical answers, and `blended` (requests the on-server blended: 0)."""
    out: dict[str, Any] = {"blended": blended, "rows": rows}
    for kind in ("miss", "hit"):
        ratio = [r[f"on_{kind}_s"] / r[f"off_{kind}_s"] for r in rows]
        out[f"plain_{kind}_ratio"] = statistics.median(ratio)
        out[f"plain_{kind}_ratio_p99"] = p99(ratio)
        out[f"plain_{kind}_ratio_min"] = min(ratio)
        for arm in ARMS:
            out[f"{arm}_{kind}_median_s"] = statistics.median(r[f"{arm}_{kind}_s"] for r in rows)
    out["plain_identical"] = statistics.fmean(r["identical"] for r in rows)
    out["plain_kl"] = statistics.fmean(r["kl"] for r in rows)
    return out


def run_plain(args: argparse.Namespace, model: Path, queries: list[list[int]],
              work: Path, separator: str) -> dict[str, Any]:
    """Both servers started one after the other (a 2-core host starting two at once takes
    minutes for each), then every query on both."""
    servers: dict[str, SGLangServer] = {}
    rows = []
    try:
        for arm in ARMS[::-1] if args.on_first else ARMS:
            servers[arm] = server_for(model, work, args, separator, name=f"plain-{arm}",
                                      blending=arm == "on" and not args.null)
            servers[arm].start()
        for q, ids in enumerate(queries):
            rows.append(_query(servers, q, ids, args.answer_tokens))
            r = rows[-1]
            print(f"query {q}: {r['tokens']} tokens, miss off {r['off_miss_s']:.2f}s on "
                  f"{r['on_miss_s']:.2f}s, hit off {r['off_hit_s']:.2f}s on {r['on_hit_s']:.2f}s "
                  f"({r['on_cached']} cached), identical {r['identical']}", flush=True)
        blended = len(BLENDED.findall(servers["on"].log()))
    finally:
        for server in servers.values():
            server.stop()
    return {"engine": "sglang-plain", "model": "SmolLM2-135M-Instruct float32",
            "args": vars(args), **summarize_plain(rows, blended)}


def table(s: dict[str, Any]) -> None:
    what = ("the null: both servers without blending, the second one's over the first's"
            if s["args"]["null"] else "blending on / off")
    print(f"\nprompts without segments, {len(s['rows'])} queries: {what}")
    print(f"{'':6s} {'off (median)':>13s} {'on (median)':>12s} {'on/off median':>14s} "
          f"{'p99':>6s} {'min':>6s}")
    for kind in ("miss", "hit"):
        print(f"{kind:6s} {s[f'off_{kind}_median_s']:>12.2f}s {s[f'on_{kind}_median_s']:>11.2f}s "
              f"{s[f'plain_{kind}_ratio']:>14.3f} {s[f'plain_{kind}_ratio_p99']:>6.3f} "
              f"{s[f'plain_{kind}_ratio_min']:>6.3f}")
    print(f"identical answers {s['plain_identical']:.2f}, first-token KL {s['plain_kl']:.2e}, "
          f"requests blended {s['blended']}")
