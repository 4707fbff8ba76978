"""Never slower than recompute? Prompts cached in a fast and a slow Redis, per prefetch policy.

TTFT against recomputing the same prompts, on real SGLang servers on CPU.

A "storing" kvtier server puts `--prompts` prompts of `--prompt-len` tokens into a Redis
(started here). Then, per run (`--runs`), each case gets a fresh server (its CPU tier is empty,
so every hit comes from Redis) that serves the same prompts one at a time, `/flush_cache` before
each (nothing comes from SGLang's device cache), in this order:

    none        no kvtier: every prompt is recomputed (the baseline; the first run's median
                TTFT is the recompute time that sets the default throttle)
    fast        kvtier on the local Redis
    throttled   kvtier on the same Redis behind a proxy (`tests/delay_proxy.py`) that delays
                every reply by `--delay-ms` and caps the replies at `--mbps` MB/s; by default
                the cap makes loading a prompt's cached chunks (after one delay) take
                `--slowdown` times recomputing the prompt

`fast` and `throttled` run once per policy in `--policies` (`prefetch_policy` in the kvtier
config; `timeout` with its default budget). Each server is warmed up with two prompts no case
uses (its first long prefill pays one-time costs; the adaptive policy also measures the prefill
speed there). Measured per request: TTFT (streaming, `--max-new-tokens` greedy tokens), SGLang's
`cached_tokens`, whether the output equals the storing server's, the tokens kvtier's log reports
loading and (throttled) the bytes through the proxy; per server, kvtier's metrics. The table
gives per case and policy the median and p99 TTFT over every request of every run, the median
cached tokens, and the ratios of the median and p99 TTFT to `none` measured in the same
invocation. Nothing is compared with a fixed number: these machines are shared and noisy.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_adaptive.py [--prompts 8] [--prompt-len 2048]
        [--runs 1] [--delay-ms 20] [--mbps auto] [--slowdown 4] [--policies adaptive,timeout]
    # a quick check (3 prompts of 1024 tokens, one run):
    PYTHONPATH=. .venv/bin/python benchmarks/bench_adaptive.py --quick

Needs the SGLang CPU environment (`make sglang-env`) and `redis-server` on PATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.common import work_dir, write_results
from kvtier.config import ConfigError, load_config
from kvtier.demo.models import LlamaSpec, cached_llama
from kvtier.demo.runner import FULL_MODEL, SMALL_MODEL
from kvtier.demo.server import (
    CPU_FLAGS,
    SGLangServer,
    cpu_shims_dir,
    free_port,
    gpu_available,
    metrics_text,
)
from tests.conftest import RedisProcess
from tests.delay_proxy import DelayProxy

MODELS = {"small": SMALL_MODEL, "full": FULL_MODEL}
POLICIES = ("adaptive", "timeout", "wait_complete", "best_effort")
FIRST_ID, VOCAB = 4, 430  # token ids every generated tokenizer has (0-3 are specials)
_LOADED = re.compile(r"kvtier: loaded (\d+) tokens")
# Shown under the table, with every `kvtier_adaptive_*` metric that is not 0 (every kvtier
# counter and gauge goes to the JSON).
SHOWN_COUNTERS = ("kvtier_sglang_tokens_loaded_total", "kvtier_bytes_read_total")
SHOWN_PREFIX = "kvtier_adaptive_"


@dataclass
class Options:
    """What one invocation runs (see `--help`)."""

    prompts: int = 8
    prompt_len: int = 2048
    runs: int = 1
    delay_ms: float = 20.0
    mbps: float | None = None  # MB/s (10^6 bytes/s); None: from --slowdown
    slowdown: float = 4.0
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

    case: str  # none, fast, throttled
    policy: str | None  # None for `none`
    run: int
    start_s: float = 0.0
    requests: list[Request] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


# ---- helpers ----

def _prompt(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


def kv_bytes_per_token(spec: LlamaSpec) -> int:
    """K and V of every layer in the float32 pool the CPU servers run with."""
    return 2 * spec.layers * spec.kv_heads * (spec.hidden // spec.heads) * 4


def scrape_metrics(port: int) -> dict[str, float]:
    """kvtier's counters and gauges from its Prometheus endpoint (without histogram buckets
    and creation times), one entry per label set; `{}` if the endpoint does not answer."""
    out: dict[str, float] = {}
    for line in metrics_text(port).splitlines():
        m = re.match(r"(kvtier_\w+(?:\{[^}]*\})?)\s+(\S+)$", line)
        if m and not re.search(r"_(bucket|created)\b", m.group(1)):
            out[m.group(1)] = float(m.group(2))
    return out


def _summed(metrics: dict[str, float], name: str) -> float | None:
    values = [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]
    return sum(values) if values else None


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


# ---- the runs ----

class Bench:
    """The model, the Redis server, the throttling proxy and every case's results."""

    def __init__(self, opts: Options, work: Path):
        self.opts = opts
        self.work = work
        self.context = opts.prompt_len + opts.max_new_tokens + 64
        self.spec = dataclasses.replace(MODELS[opts.model],
                                        max_positions=max(4096, self.context))
        self.model, _ = cached_llama(self.spec)
        self.prompts = [_prompt(f"adaptive-{i}", opts.prompt_len) for i in range(opts.prompts)]
        self.expected: list[list[int]] = []  # the storing server's outputs
        self.store_ttft_ms: list[float] = []  # the storing server's TTFTs (JSON only)
        self.redis = RedisProcess(work / "redis")
        self.proxy: DelayProxy | None = None
        self.results: list[CaseRun] = []
        self._servers = 0

    # -- servers --

    def config(self, name: str, url: str, policy: str, metrics_port: int) -> Path:
        path = self.work / f"{name}.yaml"
        arena = max(0.25, 3 * len(self.prompts) * self.opts.prompt_len
                    * kv_bytes_per_token(self.spec) / 1e9)
        path.write_text(yaml.safe_dump({
            "chunk_size": self.opts.chunk_size, "max_local_cpu_size": round(arena, 3),
            "remote_url": url, "remote_timeout_secs": 30.0, "prefetch_policy": policy,
            "metrics_port": metrics_port}))
        return path

    def server(self, name: str, config: Path | None) -> SGLangServer:
        args = ["--max-total-tokens", str(max(16384, 2 * self.context)),
                "--context-length", str(self.spec.max_positions), "--sleep-on-idle"]
        if config is not None:
            args += ["--enable-kvtier", "--kvtier-config-file", str(config)]
        threads = self.opts.threads or os.cpu_count() or 1
        shims = [] if gpu_available() else [cpu_shims_dir()]
        return SGLangServer(self.model, self.work / f"{name}.log", args=args,
                            env={"OMP_NUM_THREADS": str(threads)}, pythonpath=shims,
                            cpu_flags=CPU_FLAGS)

    def _started(self, server: SGLangServer) -> float:
        """Start and warm up `server` (two prompts no case uses, different per server, so a
        warm-up is never a hit and leaves none behind); returns the start time in seconds."""
        t0 = time.monotonic()
        server.start()
        self._servers += 1
        for i in range(2):
            server.flush_cache()
            server.generate(_prompt(f"warmup-{self._servers}-{i}", self.opts.prompt_len), 1)
        return time.monotonic() - t0

    def check_configs(self) -> None:
        """Every policy's config loads, before any server starts (a rejected policy would
        otherwise stop each launch)."""
        for policy in ("best_effort", *self.opts.policies):
            path = self.config(f"check-{policy}", "redis://127.0.0.1:6379", policy, 9400)
            try:
                load_config(path, env={})
            except ConfigError as exc:
                raise SystemExit(f"prefetch_policy {policy!r} does not load in this kvtier: "
                                 f"{exc}\n(choose others with --policies)") from None

    # -- phases --

    def store(self) -> None:
        """Put every prompt into Redis (and keep the outputs: every case must give them)."""
        metrics = free_port()
        server = self.server("store", self.config("store", self.redis.url, "best_effort",
                                                  metrics))
        try:
            self._started(server)
            for ids in self.prompts:
                server.flush_cache()
                got = server.stream_generate(ids, self.opts.max_new_tokens)
                self.expected.append(got.output_ids)
                self.store_ttft_ms.append(got.ttft_s * 1e3)
            server.flush_cache()  # returns once kvtier's Redis writes have landed
        finally:
            server.stop()
        keys = self.redis.client().dbsize()
        if not keys:
            raise SystemExit(f"the storing server left nothing in Redis: see {server.log_path}")
        print(f"stored {len(self.prompts)} prompts of {self.opts.prompt_len} tokens in Redis "
              f"({keys} keys)", flush=True)

    def throttle(self) -> dict[str, float]:
        """Start the proxy. Its bandwidth: `--mbps`, else loading one prompt's whole chunks
        at that bandwidth (after one delay) takes `--slowdown` times its recompute, the median
        TTFT of the `none` server measured so far."""
        recompute_s = statistics.median(
            q.ttft_ms for r in self.results if r.case == "none" for q in r.requests) / 1e3
        delay_s = self.opts.delay_ms / 1e3
        chunk = self.opts.chunk_size  # SGLang matches at most prompt_len - 1 tokens
        nbytes = (self.opts.prompt_len - 1) // chunk * chunk * kv_bytes_per_token(self.spec)
        if self.opts.mbps is not None:
            rate = self.opts.mbps * 1e6
        else:
            rate = nbytes / max(self.opts.slowdown * recompute_s - delay_s,
                                0.1 * self.opts.slowdown * recompute_s)
        load_s = delay_s + nbytes / rate
        print(f"throttled tier: +{self.opts.delay_ms:.0f} ms per reply, {rate / 1e6:.2f} MB/s: "
              f"one prompt's chunks ({nbytes / 1e6:.1f} MB) take >= {load_s * 1e3:.0f} ms to load, "
              f"{load_s / recompute_s:.1f}x its recompute ({recompute_s * 1e3:.0f} ms)",
              flush=True)
        self.proxy = DelayProxy(self.redis.port, delay_s, bytes_per_s=rate)
        return {"delay_ms": self.opts.delay_ms, "bytes_per_s": rate, "prompt_kv_bytes": nbytes,
                "recompute_ms": recompute_s * 1e3, "min_load_ms": load_s * 1e3,
                "load_over_recompute": load_s / recompute_s}

    def run_case(self, case: str, policy: str | None, run: int) -> CaseRun:
        result = CaseRun(case, policy, run)
        name = f"r{run}-{case}" + (f"-{policy}" if policy else "")
        metrics = free_port()
        config = None
        proxy = self.proxy if case == "throttled" else None
        if case != "none":
            assert policy is not None and (case == "fast" or proxy is not None)
            url = proxy.url if proxy is not None else self.redis.url
            config = self.config(name, url, policy, metrics)
        server = self.server(name, config)
        try:
            result.start_s = self._started(server)
            offset = len(server.log())
            marks = []  # proxy bytes before each request's flush, and at the end
            for i, ids in enumerate(self.prompts):
                marks.append(proxy.reply_bytes if proxy is not None else 0)
                server.flush_cache()
                got = server.stream_generate(ids, self.opts.max_new_tokens)
                log = server.log()
                loaded = sum(int(n) for n in _LOADED.findall(log[offset:]))
                offset = len(log)
                result.requests.append(Request(
                    i, got.ttft_s * 1e3, got.cached_tokens, got.prompt_tokens,
                    got.output_ids == self.expected[i], loaded))
            if proxy is not None:
                marks.append(proxy.reply_bytes)
                for req, a, b in zip(result.requests, marks, marks[1:]):
                    req.proxy_bytes = b - a
            if config is not None:
                result.metrics = scrape_metrics(metrics)
        finally:
            server.stop()
        self.results.append(result)
        ttfts = [r.ttft_ms for r in result.requests]
        print(f"  run {run} {case:<9} {policy or '-':<13} median TTFT "
              f"{statistics.median(ttfts):7.0f} ms, cached "
              f"{statistics.median(r.cached_tokens for r in result.requests):.0f} tokens, "
              f"server start {result.start_s:.0f} s", flush=True)
        return result

    def run(self) -> dict[str, float]:
        self.check_configs()
        throttle: dict[str, float] = {}
        self.redis.start()
        try:
            self.store()
            cases = [("none", None)] + [(case, policy) for case in ("fast", "throttled")
                                        for policy in self.opts.policies]
            for run in range(1, self.opts.runs + 1):
                for case, policy in cases:
                    if case == "throttled" and self.proxy is None:
                        throttle = self.throttle()
                    self.run_case(case, policy, run)
        finally:
            if self.proxy is not None:
                self.proxy.close()
            self.redis.stop()
        return throttle


# ---- report ----

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


def report(opts: Options, bench: Bench, throttle: dict[str, float]) -> dict[str, Any]:
    rows = summarize(bench.results)
    print(f"\nTTFT of {opts.prompts} cached prompts of {opts.prompt_len} tokens, "
          f"{opts.runs} run(s), a fresh server per case and run; throttled tier: "
          f"+{opts.delay_ms:.0f} ms per reply, {throttle['bytes_per_s'] / 1e6:.2f} MB/s "
          f"(a load >= {throttle['load_over_recompute']:.1f}x recompute)")
    print("| case | policy | median TTFT ms | p99 TTFT ms | median cached tokens "
          "| median / none | p99 / none | outputs as stored |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['policy'] or '-'} | {r['median_ttft_ms']:.0f} "
              f"| {r['p99_ttft_ms']:.0f} | {r['median_cached_tokens']:.0f} "
              f"| {_f(r['median_ratio'], '.2f')}x | {_f(r['p99_ratio'], '.2f')}x "
              f"| {r['outputs_matching']}/{r['requests']} |")
    notes = []
    for c in bench.results:
        if c.case == "none":
            continue
        names = [*SHOWN_COUNTERS, *sorted(k for k, v in c.metrics.items()
                                          if k.startswith(SHOWN_PREFIX) and v)]
        shown = ", ".join(f"{k.removeprefix('kvtier_')}={_f(_summed(c.metrics, k), '.0f')}"
                          for k in names)
        loaded = sum(q.log_loaded_tokens for q in c.requests)
        proxied = [q.proxy_bytes for q in c.requests if q.proxy_bytes is not None]
        via = f", {sum(proxied) / 1e6:.1f} MB through the proxy" if proxied else ""
        notes.append(f"  run {c.run} {c.case}/{c.policy}: log loads {loaded} tokens{via}, "
                     f"{shown}")
    if notes:
        print("\n" + "\n".join(notes))
    return {"options": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(opts).items()},
            "model": dataclasses.asdict(bench.spec), "chunk_size": opts.chunk_size,
            "kv_bytes_per_token": kv_bytes_per_token(bench.spec),
            "throttle": throttle, "store_ttft_ms": bench.store_ttft_ms, "summary": rows,
            "runs": [dataclasses.asdict(r) for r in bench.results]}


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {bad}; choose from {POLICIES}")
    return names


QUICK = {"prompts": 3, "prompt_len": 1024, "runs": 1}


def parse_args(argv: list[str] | None = None) -> Options:
    d = Options()
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--prompts", type=int, default=None, help=f"default {d.prompts}")
    p.add_argument("--prompt-len", type=int, default=None, help=f"default {d.prompt_len}")
    p.add_argument("--runs", type=int, default=None,
                   help=f"fresh servers per case, one after another (default {d.runs})")
    p.add_argument("--delay-ms", type=float, default=d.delay_ms,
                   help="the throttled tier's delay on every reply")
    p.add_argument("--mbps", type=float, default=None,
                   help="the throttled tier's bandwidth in MB/s (10^6 bytes/s); default: "
                        "from --slowdown")
    p.add_argument("--slowdown", type=float, default=d.slowdown,
                   help="without --mbps: loading a prompt from the throttled tier takes this "
                        "many times its recompute")
    p.add_argument("--policies", type=_policies, default=d.policies,
                   help=f"comma-separated prefetch policies for the kvtier cases "
                        f"(default {','.join(d.policies)})")
    p.add_argument("--model", choices=sorted(MODELS), default=d.model,
                   help="the demo's generated Llama shapes (kvtier.demo.runner)")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--threads", type=int, default=d.threads,
                   help="OMP threads per server (0: every core)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep configs and logs here (default: a temp dir, removed)")
    p.add_argument("--quick", action="store_true",
                   help="a quick check: --prompts 3 --prompt-len 1024 --runs 1 (explicit "
                        "options win)")
    ns = vars(p.parse_args(argv))
    quick = ns.pop("quick")
    for key in QUICK:
        if ns[key] is None:
            ns[key] = QUICK[key] if quick else getattr(d, key)
    opts = Options(**ns)
    if opts.prompts < 1 or opts.runs < 1 or opts.prompt_len < opts.chunk_size:
        p.error("--prompts and --runs must be >= 1, and --prompt-len at least --chunk-size")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    with work_dir("adaptive", opts.work_dir) as work:
        bench = Bench(opts, work)
        throttle = bench.run()
        out = report(opts, bench, throttle)
    write_results("bench_adaptive", out)


if __name__ == "__main__":
    main()
