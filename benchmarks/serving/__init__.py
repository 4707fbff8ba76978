"""Benchmarks that drive one real SGLang server (or a few side by side) with requests.

    bench_serving.py    SGLang's own load generator, with and without kvtier (entry point)
    runs.py             bench_serving's runs: a fresh server per run, its client
    client.py           bench_serving's client: `python -m sglang.benchmark.serving`
    procs.py            a server's processes: core pinning, CPU per thread, kvtier's counters
    report.py           bench_serving's table, ratios and notes (`-m` reprints from JSON)
    timeline.py         what each server's threads spent inside the measured window
    shared.py           bench_serving's phases, options and a run's result
    bench_adaptive.py   load or recompute on slow and far tiers, per prefetch policy (entry point)
    adaptive_report.py  bench_adaptive's records and report (and p99, KV bytes per token)
    bench_far_tier.py   a far Redis's cost to requests that miss, alternated with a server
                        without kvtier (entry point)
    bench_hit.py        a cached prefix served from each tier vs a device-cache hit (entry point)
    bench_readme_cpu.py the README's CPU launch line as written, on SmolLM2-135M (entry point)
    bench_quality.py    whether a hit changes what a real model says (entry point)
    bench_stall.py      a running stream's gaps while a hit loads from a slow tier (entry point)
    bench_tenants.py    quiet tenants' hit rate alone vs beside a tenant at 10x their rate,
                        per tenant_max_fraction (entry point)
    bench_verify.py     shadow verification's cost per share, and honest records' spread
                        (entry point)
    bench_blend.py      reuse at any position: blend vs full prefill vs naive reuse, TTFT and
                        quality on a real model (entry point; kvtier's own forward or SGLang)
    blend_sglang.py     bench_blend's `--engine sglang`: one server with enable_blending
    blend_plain.py      bench_blend's `--plain`: prompts without segments, blending on vs off
    blend_stall.py      bench_blend's `--stall`: a running stream's gaps beside a blended admission
    blend_workload.py   bench_blend's documents (a depot each) and questions (who manages one)
"""
