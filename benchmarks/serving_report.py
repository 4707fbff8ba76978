"""The serving benchmark's report: its table, its ratios against their bounds, its notes.

`benchmarks/bench_serving.py` runs the servers and the client; this module only formats what
they measured (`RunResult`s) and derives the ratios.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from benchmarks.bench_serving import Options, RunResult

DISCARDED = "kvtier_sglang_loads_discarded_total"
# Counters shown in the table's notes (every kvtier counter goes to the JSON).
SHOWN_COUNTERS = (DISCARDED, "kvtier_sglang_tokens_loaded_total", "kvtier_prefetch_timeouts_total")


def _f(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def row(r: RunResult) -> str:
    discarded = r.counters.get(DISCARDED) if r.kvtier else None
    tokens = r.input_tokens / r.client_completed if r.input_tokens and r.client_completed \
        else None
    phase = r.phase + (f" #{r.repeat}" if r.repeat > 1 else "")
    return (f"| {r.system_prompt_len} | {_f(tokens, '.0f')} | {r.rep} | {phase} "
            f"| {_f(r.duration_s, '.2f')} s "
            f"| {_f(r.mean_ttft_ms, '.0f')} | {_f(r.median_ttft_ms, '.0f')} "
            f"| {_f(r.p99_ttft_ms, '.0f')} | {_f(r.request_throughput, '.3f')} "
            f"| {r.failed}/{r.requests} | {_f(r.cached_tokens, 'd')} "
            f"| {_f(discarded, '.0f') if r.kvtier else '-'} | {r.start_s:.0f} s |")


HEADER = ("| system prompt | prompt tokens | run | phase | duration | mean TTFT ms "
          "| median TTFT ms | p99 TTFT ms | req/s | failed | cached tokens | loads discarded "
          "| server start |\n| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: | ---: |")

class Ratio(NamedTuple):
    """`num` phase / `den` phase of `attr`, and the bound the serving issue set for it (None:
    none; the ratio is shown for comparison)."""

    num: str
    den: str
    attr: str
    most: bool  # True: the ratio must stay <= bound; False: >= bound
    bound: float | None


RATIOS = {
    "p99 TTFT, first kvtier server / no kvtier": Ratio("first", "none", "p99_ttft_ms", True, 1.1),
    "p99 TTFT, first kvtier server (kernel cached) / no kvtier":
        Ratio("first-again", "none", "p99_ttft_ms", True, None),
    "mean TTFT, second kvtier server / no kvtier":
        Ratio("second", "none", "mean_ttft_ms", True, 0.35),
    "no-reuse request throughput, kvtier / none":
        Ratio("noreuse-kv", "noreuse-none", "request_throughput", False, 0.97),
    "no-reuse request throughput, kvtier / none, side by side on a core each":
        Ratio("pair-kv", "pair-none", "request_throughput", False, 0.97),
}
PAIR = RATIOS["no-reuse request throughput, kvtier / none, side by side on a core each"]


def _mean(runs: list[RunResult], attr: str) -> float | None:
    """The mean of `attr` over a phase's runs in one set (None if any lacks it)."""
    values = [getattr(r, attr) for r in runs]
    return None if not values or None in values else statistics.fmean(values)


def ratios(results: list[RunResult]) -> dict[str, dict[str, Any]]:
    """Each ratio per prompt length: one value per repetition, their median, and in how many
    repetitions the bound held. A phase run more than once in a set counts with its mean
    (e.g. `none,kv,kv,none`: a drift of the host during the set then weighs on both sides
    alike)."""
    by: dict[tuple[int, int, str], list[RunResult]] = {}
    for r in results:
        by.setdefault((r.system_prompt_len, r.rep, r.phase), []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for label, ratio in RATIOS.items():
        for length in sorted({r.system_prompt_len for r in results}):
            values = []
            for rep in sorted({r.rep for r in results}):
                x = _mean(by.get((length, rep, ratio.num), []), ratio.attr)
                y = _mean(by.get((length, rep, ratio.den), []), ratio.attr)
                if x is not None and y:
                    values.append(x / y)
            if not values:
                continue
            entry: dict[str, Any] = {"values": values, "median": statistics.median(values)}
            if ratio.bound is not None:
                bound = ratio.bound
                entry["bound"] = f"{'<=' if ratio.most else '>='} {bound}x"
                entry["held"] = sum(v <= bound if ratio.most else v >= bound for v in values)
            out[f"{label} (system prompt {length})"] = entry
    return out


# Student's t at 97.5% for n - 1 degrees of freedom (a 95% interval of a mean of n pairs).
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
         10: 2.23, 11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11,
         18: 2.10, 19: 2.09, 20: 2.09}


def pair_ratios(results: list[RunResult]) -> dict[int, dict[str, Any]]:
    """Per prompt length, the ratio of each side-by-side pair (`pair-kv` / `pair-none` of the
    same set and repeat), their mean and its 95% confidence interval. A pair's two servers
    share the host's moment, so each pair is one measurement of the ratio; the spread between
    pairs is what noise is left."""
    sides: dict[tuple[int, int, int], dict[str, float]] = {}
    for r in results:
        if r.phase in (PAIR.num, PAIR.den) and r.request_throughput:
            sides.setdefault((r.system_prompt_len, r.rep, r.repeat), {})[r.phase] = \
                r.request_throughput
    out: dict[int, dict[str, Any]] = {}
    for (length, _, _), side in sorted(sides.items()):
        if len(side) == 2:
            out.setdefault(length, {"values": []})["values"].append(
                side[PAIR.num] / side[PAIR.den])
    for entry in out.values():
        values = entry["values"]
        mean = statistics.fmean(values)
        half = (_T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
                if len(values) > 1 else float("nan"))
        assert PAIR.bound is not None
        entry.update(mean=mean, ci95=(mean - half, mean + half),
                     held=sum(v >= PAIR.bound for v in values), bound=f">= {PAIR.bound}x")
    return out


def report(opts: Options, results: list[RunResult], model: Path) -> dict[str, Any]:
    print("\nSGLang serving benchmark (`sglang.benchmark.serving`), "
          f"{opts.num_groups}x{opts.prompts_per_group} prompts, question {opts.question_len}, "
          f"output {opts.output_len}, concurrency {opts.max_concurrency}, "
          f"--max-total-tokens {opts.max_total_tokens}")
    print(HEADER)
    for r in results:
        print(row(r))
    got = ratios(results)
    if got:
        print()
        for label, v in got.items():
            each = ", ".join(f"{x:.2f}" for x in v["values"])
            held = (f"; bound {v['bound']} held in {v['held']} of {len(v['values'])}"
                    if "bound" in v else "")
            print(f"{label}: {v['median']:.2f}x (median of {each}){held}")
    pairs = pair_ratios(results)
    for length, v in pairs.items():
        low, high = v["ci95"]
        print(f"no-reuse throughput per side-by-side pair, kvtier / none (system prompt "
              f"{length}): {', '.join(f'{x:.3f}' for x in v['values'])}; mean {v['mean']:.3f} "
              f"(95% CI {low:.3f}-{high:.3f}); bound {v['bound']} held in {v['held']} of "
              f"{len(v['values'])} pairs")
    notes = []
    for r in results:
        if r.kvtier:
            shown = ", ".join(f"{k}={_f(r.counters.get(k), '.0f')}" for k in SHOWN_COUNTERS)
            notes.append(f"  {r.system_prompt_len}/{r.rep}/{r.phase}: kernel compile "
                         f"{_f(r.kernel_compile_s, '.1f')} s, log loads "
                         f"{r.log_loaded_tokens} tokens, {shown}")
        for e in r.errors:
            notes.append(f"  {r.system_prompt_len}/{r.rep}/{r.phase}: ERROR {e}")
    if notes:
        print("\n" + "\n".join(notes))
    return {"options": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(opts).items()},
            "model": str(model), "results": [vars(r) for r in results], "ratios": got,
            "pairs": {str(length): v for length, v in pairs.items()}}
