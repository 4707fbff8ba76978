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
    coldstart   a server's first kvtier requests: a fresh server warmed up with requests
                kvtier does not see (so its tier is timed by nothing but its own start-up
                probe), on the same Redis behind a proxy that holds every reply burst
                `--cold-delay-ms` (150 ms) and streams at `--cold-mbps` (2 MB/s): a far tier
                whose round trip alone costs about a prompt's recompute
    coldmiss    as coldstart, but every prompt is new (no tier holds it): what a far tier's
                lookup costs a request that misses (the `none` server serves the same
                prompts too, for their outputs; its own TTFTs stay those of the other prompts)
    coldempty   as coldstart, but the server starts on an empty Redis (behind the same kind
                of proxy), as a new instance of a fleet that comes up at once: the prompts
                arrive in that Redis after the server started (copied from the first, as
                another instance would have stored them), so only a probe of the empty
                tier can have timed it

`fast`, `throttled`, `coldstart`, `coldmiss` and `coldempty` run once per policy in `--policies`
(`prefetch_policy` in the kvtier config; `timeout` with its default budget). Each server is warmed
up with two prompts no case uses (its first long prefill pays one-time costs; the adaptive policy
also measures the prefill speed there). Measured per request: TTFT (streaming, `--max-new-tokens`
greedy tokens), SGLang's `cached_tokens`, whether the output equals the storing server's, the tokens
kvtier's log reports loading and (throttled) the bytes through the proxy; per server, kvtier's
metrics. The table gives per case and policy the median and p99 TTFT over every request of every
run, the median cached tokens, and the ratios of the median and p99 TTFT to `none` measured in the
same invocation. Nothing is compared with a fixed number: these machines are shared and noisy.

    .venv/bin/python -m benchmarks.serving.bench_adaptive [--prompts 8]
        [--prompt-len 2048] [--runs 1] [--delay-ms 20] [--mbps auto] [--slowdown 4]
        [--policies adaptive,timeout]
    # a quick check (3 prompts of 1024 tokens, one run):
    .venv/bin/python -m benchmarks.serving.bench_adaptive --quick

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
from pathlib import Path

import yaml

from benchmarks.common import SGLANG, require, work_dir, write_results
from benchmarks.serving.adaptive_report import CaseRun, Options, Request, kv_bytes_per_token, report
from harness.delay_proxy import DelayProxy
from harness.redis import RedisProcess
from kvtier.config import ConfigError, load_config
from kvtier.demo.models import cached_llama
from kvtier.demo.runner import FULL_MODEL, SMALL_MODEL
from kvtier.demo.server import (
    CPU_FLAGS,
    SGLangServer,
    cpu_shims_dir,
    free_port,
    gpu_available,
    metrics_text,
)

MODELS = {"small": SMALL_MODEL, "full": FULL_MODEL}
POLICIES = ("adaptive", "timeout", "wait_complete", "best_effort")
CASES = ("none", "fast", "throttled", "coldstart", "coldmiss", "coldempty")
FIRST_ID, VOCAB = 4, 430  # token ids every generated tokenizer has (0-3 are specials)
_LOADED = re.compile(r"kvtier: loaded (\d+) tokens")


# ---- helpers ----

def _prompt(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


def scrape_metrics(port: int) -> dict[str, float]:
    """kvtier's counters and gauges from its Prometheus endpoint (without histogram buckets
    and creation times), one entry per label set; `{}` if the endpoint does not answer."""
    out: dict[str, float] = {}
    for line in metrics_text(port).splitlines():
        m = re.match(r"(kvtier_\w+(?:\{[^}]*\})?)\s+(\S+)$", line)
        if m and not re.search(r"_(bucket|created)\b", m.group(1)):
            out[m.group(1)] = float(m.group(2))
    return out


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
        self.misses: list[list[int]] = []  # `coldmiss`'s prompts this run, stored nowhere
        self.miss_expected: list[list[int]] = []  # the `none` server's outputs for them
        self.store_ttft_ms: list[float] = []  # the storing server's TTFTs (JSON only)
        self.redis = RedisProcess(work / "redis")
        self.empty_redis = RedisProcess(work / "redis-empty")  # `coldempty`'s
        self.proxy: DelayProxy | None = None
        self.cold_proxy: DelayProxy | None = None
        self.empty_proxy: DelayProxy | None = None
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

    def _started(self, server: SGLangServer, *, unseen: bool = False) -> float:
        """Start and warm up `server` (two prompts no case uses, different per server, so a
        warm-up is never a hit and leaves none behind; `unseen`: namespaced with an
        `extra_key`, which kvtier bypasses, so kvtier's tiers see none of them); returns the
        start time in seconds."""
        t0 = time.monotonic()
        server.start()
        self._servers += 1
        for i in range(2):
            server.flush_cache()
            ids = _prompt(f"warmup-{self._servers}-{i}", self.opts.prompt_len)
            if unseen:
                server.post("/generate", {"input_ids": ids, "extra_key": f"warmup-{i}",
                                          "sampling_params": {"max_new_tokens": 1}})
            else:
                server.generate(ids, 1)
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
        proxy = {"throttled": self.proxy, "coldstart": self.cold_proxy,
                 "coldmiss": self.cold_proxy, "coldempty": self.empty_proxy}.get(case)
        if case == "none":  # new prompts for this run's `coldmiss` (its servers store them)
            self.misses = [_prompt(f"miss-{run}-{i}", self.opts.prompt_len)
                           for i in range(self.opts.prompts)]
        prompts, expected = (self.misses, self.miss_expected) if case == "coldmiss" \
            else (self.prompts, self.expected)
        if case == "coldempty":
            self.empty_redis.client().flushall()
        if case != "none":
            assert policy is not None and (case == "fast" or proxy is not None)
            url = proxy.url if proxy is not None else self.redis.url
            config = self.config(name, url, policy, metrics)
        server = self.server(name, config)
        try:
            result.start_s = self._started(server, unseen=case.startswith("cold"))
            if case == "coldempty":  # stored by "another instance" after this one started
                copied = _copy_records(self.redis, self.empty_redis)
                print(f"  {copied} keys arrived in the (so far empty) Redis after the server "
                      f"started", flush=True)
            offset = len(server.log())
            marks = []  # proxy bytes before each request's flush, and at the end
            for i, ids in enumerate(prompts):
                marks.append(proxy.reply_bytes if proxy is not None else 0)
                server.flush_cache()
                got = server.stream_generate(ids, self.opts.max_new_tokens)
                log = server.log()
                loaded = sum(int(n) for n in _LOADED.findall(log[offset:]))
                offset = len(log)
                result.requests.append(Request(
                    i, got.ttft_s * 1e3, got.cached_tokens, got.prompt_tokens,
                    got.output_ids == expected[i], loaded))
            if case == "none":
                self.miss_expected = [server.generate(ids, self.opts.max_new_tokens)
                                      ["output_ids"] for ids in self.misses]
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
        self.empty_redis.start()
        try:
            self.store()
            cold = {"delay_s": self.opts.cold_delay_ms / 1e3,
                    "bytes_per_s": self.opts.cold_mbps * 1e6}
            self.cold_proxy = DelayProxy(self.redis.port, **cold)
            self.empty_proxy = DelayProxy(self.empty_redis.port, **cold)
            cases = [("none", None)] + [(case, policy) for case in CASES[1:]
                                        for policy in self.opts.policies]
            for run in range(1, self.opts.runs + 1):
                for case, policy in cases:
                    if case == "throttled" and self.proxy is None:
                        throttle = self.throttle()
                    self.run_case(case, policy, run)
        finally:
            for proxy in (self.proxy, self.cold_proxy, self.empty_proxy):
                if proxy is not None:
                    proxy.close()
            self.redis.stop()
            self.empty_redis.stop()
        return throttle


def _copy_records(source: RedisProcess, dest: RedisProcess) -> int:
    """Copy every key of `source` into `dest` (DUMP/RESTORE, no TTL); how many."""
    src, dst = source.client(), dest.client()
    n = 0
    for name in src.scan_iter(count=1000):
        dst.restore(name, 0, src.dump(name), replace=True)
        n += 1
    return n


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
    p.add_argument("--cold-delay-ms", type=float, default=d.cold_delay_ms,
                   help="the coldstart case's Redis: delay on every reply burst")
    p.add_argument("--cold-mbps", type=float, default=d.cold_mbps,
                   help="the coldstart case's Redis: bandwidth in MB/s")
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
    require("bench_adaptive", SGLANG)
    with work_dir("adaptive", opts.work_dir) as work:
        bench = Bench(opts, work)
        throttle = bench.run()
        out = report(opts, bench.results, bench.spec, bench.store_ttft_ms, throttle)
    write_results("bench_adaptive", out)


if __name__ == "__main__":
    main()
