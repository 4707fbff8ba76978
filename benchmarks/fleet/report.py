"""The fleet benchmark's report: its table, the failover's line, the JSON and a plot."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from benchmarks.fleet.shared import FleetRun, Options


def _f(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def row(run: FleetRun, single: float | None) -> str:
    c = run.client
    rel = run.cached_fraction / single if single and run.cached_fraction is not None else None
    t = run.tier_counters
    return (f"| {run.name} | {run.policy} | {run.servers} | {c.failed}/{c.requests} "
            f"| {_f(run.cached_fraction, '.3f')} | {_f(rel, '.2f')} "
            f"| {_f(c.mean_ttft_ms, '.0f')} | {_f(c.median_ttft_ms, '.0f')} "
            f"| {_f(c.request_throughput, '.2f')} "
            f"| {_f(t.get('redis.puts'), '.0f') if run.kvtier else '-'} "
            f"| {_f(t.get('redis.write_present'), '.0f') if run.kvtier else '-'} |")


HEADER = ("| run | policy | servers | failed | cached fraction | vs single | mean TTFT ms "
          "| median TTFT ms | req/s | Redis chunks written | writes skipped (held) |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def report(opts: Options, runs: list[FleetRun]) -> dict[str, Any]:
    single = next((r.cached_fraction for r in runs if r.name == "single"), None)
    print(f"\nFleet benchmark: {opts.servers} servers, {opts.router}, Redis Cluster 3+3; "
          f"{opts.num_groups}x{opts.prompts_per_group} prompts, system prompt "
          f"{opts.system_prompt_len}, concurrency {opts.max_concurrency}, "
          f"--max-total-tokens {opts.max_total_tokens}")
    print(HEADER)
    for run in runs:
        print(row(run, single))
    for run in runs:
        f = run.failover
        if f is not None:
            print(f"\nfailover: master :{f.victim_port} SIGKILLed holding {f.victim_records} "
                  f"records; promoted after {_f(f.promoted_s, '.1f')} s; hits resumed "
                  f"{_f(f.resumed_s, '.1f')} s after the promotion; records lost "
                  f"{f.lost_records}; failed requests {run.client.failed} (client) + "
                  f"{f.failed_probes} (probes)")
        for e in run.client.errors:
            print(f"  {run.name}: ERROR {e}")
    return {"options": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(opts).items()},
            "single_cached_fraction": single,
            "runs": [dataclasses.asdict(r) for r in runs]}


def plot(runs: list[FleetRun], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in runs if r.cached_fraction is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r.name for r in shown], [r.cached_fraction for r in shown],
           color=["#888" if not r.kvtier else "#2a7" for r in shown])
    ax.set_ylabel("cached-token fraction")
    ax.set_title("A fleet behind one gateway on one Redis Cluster")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
