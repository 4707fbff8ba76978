"""bench_adaptive.py's records and its report: one measured request, one fresh server's run,
the table per case and policy with its ratios to `none` measured in the same invocation."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.demo.models import LlamaSpec

# Shown under the table, with every `kvtier_adaptive_*` metric that is not 0 (every kvtier
# counter and gauge goes to the JSON).
SHOWN_PREFIX = "kvtier_adaptive_"
SHOWN_COUNTERS = ("kvtier_sglang_tokens_loaded_total", "kvtier_bytes_read_total")


@dataclass
class Options:
    """What one invocation runs (see `--help`)."""

    prompts: int = 8
    prompt_len: int = 2048
    runs: int = 1
    delay_ms: float = 20.0
    mbps: float | None = None  # MB/s (10^6 bytes/s); None: from --slowdown
    slowdown: float = 4.0
    # The cold-start case: a fresh server whose first kvtier requests meet a far Redis (every
    # reply burst held this long, then this bandwidth).
    cold_delay_ms: float = 150.0
    cold_mbps: float = 2.0
    policies: tuple[str, ...] = ("adaptive", "timeout")
    model: str = "small"
    chunk_size: int = 256
    max_new_tokens: int = 2
    threads: int = 0  # OMP threads per server; 0: every core
    work_dir: Path | None = None


@dataclass
class Request:
    """One measured request."""

    prompt: int
    ttft_ms: float
    cached_tokens: int
    prompt_tokens: int
    output_matches: bool
    log_loaded_tokens: int
    proxy_bytes: int | None = None


@dataclass
class CaseRun:
    """One fresh server serving every prompt once."""

    case: str  # none, fast, throttled, coldstart, coldmiss, coldempty
    policy: str | None  # None for `none`
    run: int
    start_s: float = 0.0
    requests: list[Request] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def kv_bytes_per_token(spec: LlamaSpec) -> int:
    """K and V of every layer in the float32 pool the CPU servers run with."""
    return 2 * spec.layers * spec.kv_heads * (spec.hidden // spec.heads) * 4


def _summed(metrics: dict[str, float], name: str) -> float | None:
    values = [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]
    return sum(values) if values else None


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def summarize(results: list[CaseRun]) -> list[dict[str, Any]]:
    """Per case and policy, over every request of every run; ratios to `none`."""
    groups: dict[tuple[str, str | None], list[CaseRun]] = {}
    for r in results:
        groups.setdefault((r.case, r.policy), []).append(r)
    base = groups.get(("none", None), [])
    base_ttft = [q.ttft_ms for r in base for q in r.requests]
    rows = []
    for (case, policy), runs in groups.items():
        reqs = [q for r in runs for q in r.requests]
        ttft = [q.ttft_ms for q in reqs]
        row: dict[str, Any] = {
            "case": case, "policy": policy, "requests": len(reqs),
            "median_ttft_ms": statistics.median(ttft), "p99_ttft_ms": p99(ttft),
            "median_cached_tokens": statistics.median(q.cached_tokens for q in reqs),
            "outputs_matching": sum(q.output_matches for q in reqs),
            "median_ratio": None, "p99_ratio": None, "median_ratio_per_run": []}
        if base_ttft:
            row["median_ratio"] = row["median_ttft_ms"] / statistics.median(base_ttft)
            row["p99_ratio"] = row["p99_ttft_ms"] / p99(base_ttft)
            by_run = {r.run: r for r in base}
            for r in runs:
                if r.run in by_run:
                    row["median_ratio_per_run"].append(
                        statistics.median(q.ttft_ms for q in r.requests)
                        / statistics.median(q.ttft_ms for q in by_run[r.run].requests))
        rows.append(row)
    return rows


def _f(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def report(opts: Options, results: list[CaseRun], spec: LlamaSpec, store_ttft_ms: list[float],
           throttle: dict[str, float]) -> dict[str, Any]:
    rows = summarize(results)
    print(f"\nTTFT of {opts.prompts} cached prompts of {opts.prompt_len} tokens, "
          f"{opts.runs} run(s), a fresh server per case and run; throttled tier: "
          f"+{opts.delay_ms:.0f} ms per reply, {throttle['bytes_per_s'] / 1e6:.2f} MB/s "
          f"(a load >= {throttle['load_over_recompute']:.1f}x recompute); coldstart: a fresh "
          f"server, warmed up without kvtier, its Redis +{opts.cold_delay_ms:.0f} ms per reply "
          f"burst at {opts.cold_mbps:g} MB/s; coldmiss: the same, with prompts no tier holds; "
          f"coldempty: the same, started on an empty Redis that the prompts reach afterwards")
    print("| case | policy | median TTFT ms | p99 TTFT ms | median cached tokens "
          "| median / none | p99 / none | outputs as stored |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['policy'] or '-'} | {r['median_ttft_ms']:.0f} "
              f"| {r['p99_ttft_ms']:.0f} | {r['median_cached_tokens']:.0f} "
              f"| {_f(r['median_ratio'], '.2f')}x | {_f(r['p99_ratio'], '.2f')}x "
              f"| {r['outputs_matching']}/{r['requests']} |")
    notes = []
    for c in results:
        if c.case == "none":
            continue
        names = [*SHOWN_COUNTERS, *sorted(k for k, v in c.metrics.items()
                                          if k.startswith(SHOWN_PREFIX) and v)]
        shown = ", ".join(f"{k.removeprefix('kvtier_')}={_f(_summed(c.metrics, k), '.0f')}"
                          for k in names)
        loaded = sum(q.log_loaded_tokens for q in c.requests)
        proxied = [q.proxy_bytes for q in c.requests if q.proxy_bytes is not None]
        via = f", {sum(proxied) / 1e6:.1f} MB through the proxy" if proxied else ""
        waited = _summed(c.metrics, "kvtier_hit_seconds_sum")
        notes.append(f"  run {c.run} {c.case}/{c.policy}: log loads {loaded} tokens{via}, "
                     f"requests waited {_f(waited, '.3f')} s on kvtier in all, {shown}")
    if notes:
        print("\n" + "\n".join(notes))
    return {"options": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(opts).items()},
            "model": dataclasses.asdict(spec), "chunk_size": opts.chunk_size,
            "kv_bytes_per_token": kv_bytes_per_token(spec),
            "throttle": throttle, "store_ttft_ms": store_ttft_ms, "summary": rows,
            "runs": [dataclasses.asdict(r) for r in results]}


