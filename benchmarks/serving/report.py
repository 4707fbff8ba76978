"""The serving benchmark's report: its table, its ratios against their bounds, its notes.

`benchmarks/serving/bench_serving.py` runs the servers and the client; this module only formats what
they measured (`RunResult`s, from `shared`) and derives the ratios.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.serving.shared import Options, RunResult

DISCARDED = "kvtier_sglang_loads_discarded_total"
# Counters shown in the table's notes (every kvtier counter goes to the JSON).
SHOWN_COUNTERS = (DISCARDED, "kvtier_sglang_tokens_loaded_total", "kvtier_prefetch_timeouts_total",
                  "kvtier_sglang_verified_requests_total", "kvtier_verify_checked_total",
                  "kvtier_verify_mismatch_total")


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


def cpu_groups(r: RunResult) -> dict[str, float]:
    """`r.cpu_s` per completed request, in groups: the scheduler's main thread (the engine),
    kvtier's own threads, the Redis server (kvtier runs), and the rest of the server's threads
    (tokenizer, detokenizer, SGLang's helpers)."""
    n = max(1, r.completed)
    return {g: s / n for g, s in group_cpu(r.cpu_s).items()}


def group_cpu(cpu_s: dict[str, float]) -> dict[str, float]:
    """CPU seconds by thread name (`thread_cpu`) summed in `cpu_groups`' groups."""
    groups = {"engine": 0.0, "kvtier": 0.0, "redis": 0.0, "other": 0.0}
    for name, seconds in cpu_s.items():
        group = ("engine" if name.startswith("sglang::schedul") and name.endswith("*")
                 else "kvtier" if name.startswith("kv-")
                 else "redis" if name.startswith("redis-server") else "other")
        groups[group] += seconds
    return groups


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
    "request throughput, second kvtier server verifying `--verify-fraction` / not":
        Ratio("second-verify", "second", "request_throughput", False, 0.98),
    "no-reuse request throughput, kvtier / none":
        Ratio("noreuse-kv", "noreuse-none", "request_throughput", False, 0.97),
    "no-reuse request throughput, kvtier / none, side by side on a core each":
        Ratio("pair-kv", "pair-none", "request_throughput", False, 0.97),
    "no-reuse request throughput, no kvtier on either side, side by side (the method's own)":
        Ratio("null-b", "null-a", "request_throughput", False, None),
}
PAIR = RATIOS["no-reuse request throughput, kvtier / none, side by side on a core each"]
NULL_PAIR = RATIOS["no-reuse request throughput, no kvtier on either side, side by side (the "
                   "method's own)"]


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


def expected_verify(results: list[RunResult], fraction: float) -> dict[int, float]:
    """Per prompt length, the throughput that verifying `fraction` of the `second` server's
    requests should keep, if each verified request costs a miss (`none`'s time per request)
    instead of a hit (`second`'s): 1 / (1 + fraction * (miss / hit - 1)). The measured
    `second-verify` runs sample few requests at a small share; this says what they average to."""
    out = {}
    for length in sorted({r.system_prompt_len for r in results}):
        per = {}
        for phase in ("none", "second"):
            rates = [r.request_throughput for r in results
                     if r.system_prompt_len == length and r.phase == phase
                     and r.request_throughput]
            if rates:
                per[phase] = 1 / statistics.median(rates)
        if len(per) == 2:
            out[length] = 1 / (1 + fraction * (per["none"] / per["second"] - 1))
    return out


# Student's t at 97.5% for n - 1 degrees of freedom (a 95% interval of a mean of n pairs).
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
         10: 2.23, 11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11,
         18: 2.10, 19: 2.09, 20: 2.09}


def pair_ratios(results: list[RunResult], pair: Ratio = PAIR) -> dict[int, dict[str, Any]]:
    """Per prompt length, the ratio of each side-by-side pair (`pair.num` / `pair.den` of the
    same set and repeat: `pair-kv` / `pair-none`, or `NULL_PAIR`'s), their mean and its 95%
    confidence interval. A pair's two servers share the host's moment, so each pair is one
    measurement of the ratio; the spread between pairs is what noise is left."""
    sides: dict[tuple[int, int, int], dict[str, RunResult]] = {}
    for r in results:
        if r.phase in (pair.num, pair.den) and r.request_throughput:
            sides.setdefault((r.system_prompt_len, r.rep, r.repeat), {})[r.phase] = r
    out: dict[int, dict[str, Any]] = {}
    for (length, _, _), side in sorted(sides.items()):
        if len(side) == 2:
            kv, none = side[pair.num], side[pair.den]
            entry = out.setdefault(length, {"values": [], "cpu": [], "by_core": {},
                                            "same_speed": [], "compute": []})
            ratio = kv.request_throughput / none.request_throughput
            entry["values"].append(ratio)
            same = same_speed(kv, none)
            if same is not None:
                entry["same_speed"].append(same[0])
                entry["compute"].append(same[1])
            entry["by_core"].setdefault(kv.core, []).append(ratio)
            # What kvtier's side spent per request, against the other side: its own cost,
            # without the time other processes took from its core.
            spent = sum(cpu_groups(kv).values()), sum(cpu_groups(none).values())
            entry["cpu"].append(spent[0] / spent[1] if all(spent) else None)
    for entry in out.values():
        values = entry["values"]
        entry.update(_mean_ci(values))
        if pair.bound is not None:
            entry.update(held=sum(v >= pair.bound for v in values), bound=f">= {pair.bound}x")
        entry["balanced"] = _core_balanced(entry["by_core"])
        for name in ("same_speed", "compute"):
            if len(entry[name]) > 1:
                entry[f"{name}_mean"] = _mean_ci(entry[name])
    return out


def same_speed(num: RunResult, den: RunResult) -> tuple[float, float] | None:
    """`num`'s throughput against `den`'s as if both had computed at `den`'s speed, and the
    ratio of their compute times; None without both sides' forward logs.

    A run's time is the scheduler thread's CPU inside its model forwards (the model's compute,
    the same tokens on both sides, at its core's speed) plus the rest: forwards waiting for a
    core someone else held, and everything outside the forwards (scheduling, kvtier's calls,
    waits for a store or a prefetch). The two cores of this shared host compute up to 7% apart
    in one pair and swap which is faster, while the rest holds kvtier's whole cost. So the ratio
    keeps each side's rest and gives both `den`'s compute: (C_den + R_den) / (C_den + R_num).
    The compute ratio C_num / C_den stays beside it: averaged over pairs it shows whether
    kvtier slows the model's own compute (the cores' difference averages out)."""
    if not (num.duration_s and den.duration_s):
        return None
    c_num, c_den = _compute_s(num), _compute_s(den)
    if not (c_num and c_den):
        return None
    rest_num, rest_den = num.duration_s - c_num, den.duration_s - c_den
    return (c_den + rest_den) / (c_den + rest_num), c_num / c_den


def calibrated(kv: dict[str, Any], null: dict[str, Any]) -> dict[str, Any] | None:
    """kvtier's own effect with each seat's bias taken out: per core, the kvtier pairs with
    kvtier on that core against the null pairs whose second side sat there (geometric means),
    and the geometric mean of the two cores. A seat's speed (its core, the idle Redis beside
    it) then counts on both sides of the division. The 95% interval combines each group's
    spread of log ratios (Student's t, the pairs' count less the four groups' means as degrees
    of freedom); None unless both cores have a kvtier and a null pair."""
    cores = sorted(set(kv["by_core"]) & set(null["by_core"]), key=str)
    if len(cores) != 2:
        return None
    per_core, centre, var = {}, 0.0, 0.0
    groups = [kv["by_core"][c] for c in cores] + [null["by_core"][c] for c in cores]
    for core in cores:
        logs_kv = [math.log(x) for x in kv["by_core"][core]]
        logs_null = [math.log(x) for x in null["by_core"][core]]
        rel = statistics.fmean(logs_kv) - statistics.fmean(logs_null)
        per_core[str(core)] = math.exp(rel)
        centre += rel / 2
        for logs in (logs_kv, logs_null):
            var += (statistics.variance(logs) / len(logs) if len(logs) > 1 else math.nan) / 4
    df = sum(len(g) for g in groups) - len(groups)
    half = _T975.get(df, 1.96) * math.sqrt(var) if df > 0 else math.nan
    return {"per_core": per_core, "estimate": math.exp(centre),
            "ci95": (math.exp(centre - half), math.exp(centre + half))}


def _compute_s(r: RunResult) -> float | None:
    """The scheduler thread's CPU seconds in the model's forwards for the run's requests: the
    prompt tokens it computed (the client's count less the cached ones) at the run's CPU per
    extend token, plus its decode steps. A rate, not the window's sum: the window is placed
    from the client's result file, and one prefill more or less at its edge is 1.6 s here."""
    f = r.forward
    if not f or not f["extend_tokens"] or not r.input_tokens:
        return None
    computed = r.input_tokens - (r.cached_tokens or 0)
    return f["extend_cpu_s"] / f["extend_tokens"] * computed + f["decode_cpu_s"]


def _core_balanced(by_core: dict[int | None, list[float]]) -> dict[str, Any] | None:
    """The pairs in blocks of two, one with kvtier on each core (in the order they ran), each
    block's geometric mean, their mean and its 95% interval. The two cores of a shared host
    differ in speed (here every virtio interrupt lands on cpu0; seen as pairs of 0.89 and 0.98
    with kvtier on cpu0, 1.06 twice on cpu1), and a block cancels a steady difference."""
    if len(by_core) != 2:
        return None
    first, second = by_core.values()
    blocks = [(a * b) ** 0.5 for a, b in zip(first, second)]
    return {"blocks": blocks, **_mean_ci(blocks)} if blocks else None


def _mean_ci(values: list[float]) -> dict[str, Any]:
    """The mean of `values` and its 95% confidence interval (Student's t; NaN for one)."""
    mean = statistics.fmean(values)
    half = (_T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
            if len(values) > 1 else float("nan"))
    return {"mean": mean, "ci95": (mean - half, mean + half)}


def _pair_lines(title: str, length: int, v: dict[str, Any]) -> str:
    low, high = v["ci95"]
    held = (f"; bound {v['bound']} held in {v['held']} of {len(v['values'])} pairs"
            if "bound" in v else "")
    lines = [f"no-reuse throughput per side-by-side pair, {title} (system prompt {length}): "
             f"{', '.join(f'{x:.3f}' for x in v['values'])}; mean {v['mean']:.3f} "
             f"(95% CI {low:.3f}-{high:.3f}){held}"]
    if v["balanced"]:
        b = v["balanced"]
        lines.append(f"  core-balanced (one pair with each side on each core per block): "
                     f"{', '.join(f'{x:.3f}' for x in b['blocks'])}; mean {b['mean']:.3f} "
                     f"(95% CI {b['ci95'][0]:.3f}-{b['ci95'][1]:.3f})")
    for name, what in (("same_speed", "at one compute speed (the rest of each run kept)"),
                       ("compute", "compute time, second side / first")):
        if f"{name}_mean" in v:
            m = v[f"{name}_mean"]
            lines.append(f"  {what}: {', '.join(f'{x:.3f}' for x in v[name])}; mean "
                         f"{m['mean']:.3f} (95% CI {m['ci95'][0]:.3f}-{m['ci95'][1]:.3f})")
    lines.append(f"  CPU per request, second side / first (kvtier's threads and Redis included): "
                 f"{', '.join(_f(x, '.3f') for x in v['cpu'])}")
    return "\n".join(lines)


def _notes(r: RunResult) -> list[str]:
    """One run's lines under the report: its CPU per request and inside the measured window,
    its forwards, kvtier's evidence, its errors."""
    label = f"  {r.system_prompt_len}/{r.rep}/{r.phase}" + (f" #{r.repeat}" if r.repeat > 1
                                                          else "")
    out = []
    if r.cpu_s:
        cpu = cpu_groups(r)
        out.append(f"{label}: CPU s per request: " + ", ".join(f"{g} {s:.3f}" for g, s in
                                                             cpu.items())
                   + f"; total {sum(cpu.values()):.3f}")
    if r.in_run is not None and r.duration_s:
        spent = ", ".join(f"{g} {r.in_run[g]:.2f}" for g in ("engine", "kvtier", "redis",
                                                             "other"))
        writes = (f"; lower-tier writes {r.in_run['writes']:.0f}"
                  if any(row[-1] for row in r.timeline) else "")
        out.append(f"{label}: CPU s inside the measured {r.duration_s:.1f} s: {spent}{writes}")
    f = r.forward
    if f and f["extend_tokens"] and r.duration_s:
        decodes = max(1, f["decode_count"])
        out.append(f"    forwards: {f['extend_count']:.0f} extends, "
                   f"{f['extend_cpu_s'] / f['extend_tokens'] * 1e6:.0f} us CPU and "
                   f"{f['extend_wall_s'] / f['extend_tokens'] * 1e6:.0f} us wall per token; "
                   f"{f['decode_count']:.0f} decodes, {f['decode_cpu_s'] / decodes * 1e3:.1f} ms "
                   f"CPU and {f['decode_wall_s'] / decodes * 1e3:.1f} ms wall each; forwards "
                   f"{f['extend_wall_s'] + f['decode_wall_s']:.2f} s of the "
                   f"{r.duration_s:.1f} s")
    if r.kvtier:
        shown = ", ".join(f"{k}={_f(r.counters.get(k), '.0f')}" for k in SHOWN_COUNTERS)
        out.append(f"{label}: kernel compile {_f(r.kernel_compile_s, '.1f')} s, log loads "
                   f"{r.log_loaded_tokens} tokens, {shown}")
    out += [f"{label}: ERROR {e}" for e in r.errors]
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
    for length, v in expected_verify(results, opts.verify_fraction).items():
        print(f"request throughput expected at verify_fraction {opts.verify_fraction} from the "
              f"cost of a miss (none) over a hit (second), system prompt {length}: "
              f"{v:.3f}x")
    pairs = pair_ratios(results)
    nulls = pair_ratios(results, NULL_PAIR)
    for title, found in (("kvtier / none", pairs), ("no kvtier / no kvtier", nulls)):
        for length, v in found.items():
            print(_pair_lines(title, length, v))
    seated = {length: calibrated(v, nulls[length]) for length, v in pairs.items()
              if length in nulls}
    for length, c in seated.items():
        if c is not None:
            print(f"no-reuse throughput, kvtier / none with each seat's bias taken out (null "
                  f"pairs; system prompt {length}): {c['estimate']:.3f} (95% CI "
                  f"{c['ci95'][0]:.3f}-{c['ci95'][1]:.3f}); per core "
                  + ", ".join(f"{core}: {x:.3f}" for core, x in c["per_core"].items()))
    notes = [line for r in results for line in _notes(r)]
    if notes:
        print("\n" + "\n".join(notes))
    return {"options": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(opts).items()},
            "model": str(model), "results": [vars(r) for r in results], "ratios": got,
            "pairs": {str(length): v for length, v in pairs.items()},
            "null_pairs": {str(length): v for length, v in nulls.items()},
            "calibrated": {str(length): c for length, c in seated.items()}}


def main(argv: list[str] | None = None) -> None:
    """Print the report again from result files (`benchmarks/results/bench_serving.json`, or
    several runs' files together: their pairs pool)."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(description="the serving benchmark's report, from its JSON")
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv if argv is not None else sys.argv[1:])
    results: list[RunResult] = []
    data: dict[str, Any] = {}
    for i, path in enumerate(args.files):
        data = json.loads(path.read_text())
        for r in data["results"]:
            # Sets of different files must not pair with each other: their reps stay apart.
            results.append(RunResult(**{**r, "rep": r["rep"] + 1000 * i}))
    fields = Options.__dataclass_fields__
    opts = Options(**{k: v for k, v in data["options"].items() if k in fields})
    report(opts, results, Path(data["model"]))


if __name__ == "__main__":
    main()
