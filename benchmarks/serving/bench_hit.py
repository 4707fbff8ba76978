"""How close is a kvtier hit to a device-cache hit? The same prompt, served from each place.

Real SGLang servers on CPU (the demo's generated Llama), one request at a time, streaming
`--max-new-tokens` greedy tokens; TTFT per request. For each prompt length in `--lengths`,
`--repeats` different prompts are served:

    recompute   a server without kvtier, device cache flushed before each request
    device      the same server, the same prompt again (SGLang's own radix cache)
    cpu         a kvtier server (CPU + disk + Redis) that served the prompt once, device
                cache flushed: kvtier's CPU tier
    disk        a fresh kvtier server on that disk directory (CPU + disk): its CPU tier is
                empty, so the hit comes from disk
    redis       a fresh kvtier server on that Redis (CPU + Redis)

Each kvtier row is reported as a ratio to the device-cache hit of the same length, next to the
time a plain memcpy of the loaded KV bytes takes in this process (the floor of any load).
Then a `--turns`-turn conversation on a fresh kvtier server, device cache flushed before each
turn: the tokens each turn found cached against what the previous turn computed (its prompt
and answer). kvtier's `kvtier_hit_seconds` histogram (lookup, gate, copy, insert) is read from
the CPU-tier server. Prints tables, writes benchmarks/results/bench_hit.json.

    .venv/bin/python -m benchmarks.serving.bench_hit [--lengths 1024,4096,16384]
        [--repeats 3] [--turns 4]
    .venv/bin/python -m benchmarks.serving.bench_hit --quick   # 1024 and 4096, 2 each

Needs the SGLang CPU environment (`make sglang-env`) and `redis-server` on PATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks.common import SGLANG, require, work_dir, write_results
from benchmarks.serving.adaptive_report import kv_bytes_per_token, p99
from benchmarks.serving.bench_adaptive import _prompt, scrape_metrics
from harness.redis import RedisProcess
from kvtier.demo.models import cached_llama
from kvtier.demo.runner import FULL_MODEL, SMALL_MODEL
from kvtier.demo.server import CPU_FLAGS, SGLangServer, cpu_shims_dir, free_port, gpu_available

MODELS = {"small": SMALL_MODEL, "full": FULL_MODEL}
ROWS = ("recompute", "device", "cpu", "disk", "redis")
PIECES = ("lookup", "gate", "copy", "insert")


@dataclass
class Options:
    lengths: tuple[int, ...] = (1024, 4096, 16384)
    repeats: int = 3
    turns: int = 4
    turn_len: int = 512  # tokens each conversation turn adds before the answer
    model: str = "full"
    chunk_size: int = 256
    max_new_tokens: int = 1
    threads: int = 0
    work_dir: Path | None = None


@dataclass
class Served:
    row: str
    length: int
    ttft_ms: float
    cached_tokens: int
    output_matches: bool


@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    previous_computed: int  # the previous turn's prompt plus answer
    ttft_ms: float


@dataclass
class Results:
    served: list[Served] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    hit_pieces_ms: dict[str, float] = field(default_factory=dict)
    memcpy_ms: dict[int, float] = field(default_factory=dict)  # cached tokens -> ms


class Bench:
    def __init__(self, opts: Options, work: Path):
        self.opts = opts
        self.work = work
        longest = max(opts.lengths + (opts.turns * (opts.turn_len + 64),))
        self.context = longest + opts.max_new_tokens + 64
        self.spec = dataclasses.replace(MODELS[opts.model],
                                        max_positions=max(4096, self.context))
        self.model, _ = cached_llama(self.spec)
        self.prompts = {n: [_prompt(f"hit-{n}-{i}", n) for i in range(opts.repeats)]
                        for n in opts.lengths}
        self.expected: dict[tuple[int, int], list[int]] = {}
        self.redis = RedisProcess(work / "redis")
        self.disk = work / "disk"
        self.results = Results()

    def config(self, name: str, *, disk: bool, redis: bool, metrics: int) -> Path:
        kv = kv_bytes_per_token(self.spec)
        total = sum(n * self.opts.repeats for n in self.opts.lengths) + self.context
        arena = round(max(0.25, 2 * total * kv / 1e9), 3)
        cfg: dict[str, Any] = {"chunk_size": self.opts.chunk_size, "max_local_cpu_size": arena,
                               "metrics_port": metrics, "prefetch_policy": "wait_complete"}
        if disk:
            cfg.update(local_disk=str(self.disk), max_local_disk_size=round(2 * arena, 3))
        if redis:
            cfg.update(remote_url=self.redis.url, remote_timeout_secs=30.0)
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def server(self, name: str, config: Path | None) -> SGLangServer:
        args = ["--max-total-tokens", str(max(32768, 2 * self.context)),
                "--context-length", str(self.spec.max_positions), "--sleep-on-idle"]
        if config is not None:
            args += ["--enable-kvtier", "--kvtier-config-file", str(config)]
        threads = self.opts.threads or os.cpu_count() or 1
        server = SGLangServer(self.model, self.work / f"{name}.log", args=args,
                              env={"OMP_NUM_THREADS": str(threads)},
                              pythonpath=[] if gpu_available() else [cpu_shims_dir()],
                              cpu_flags=CPU_FLAGS)
        server.start()
        for i in range(2):  # one-time costs of the first long prefills; never a later hit
            server.flush_cache()
            server.generate(_prompt(f"warmup-{name}-{i}", 1024), 1)
        return server

    def serve(self, server: SGLangServer, row: str | None, *, flush: bool = True) -> None:
        for n, prompts in self.prompts.items():
            for i, ids in enumerate(prompts):
                if flush:
                    server.flush_cache()
                got = server.stream_generate(ids, self.opts.max_new_tokens)
                expected = self.expected.setdefault((n, i), got.output_ids)
                if row is not None:
                    self.results.served.append(Served(row, n, got.ttft_s * 1e3,
                                                      got.cached_tokens,
                                                      got.output_ids == expected))

    def run(self) -> None:
        self.redis.start()
        try:
            self._run()
        finally:
            self.redis.stop()

    def _run(self) -> None:
        plain = self.server("none", None)
        try:
            for n, prompts in self.prompts.items():
                for i, ids in enumerate(prompts):
                    for row, flush in (("recompute", True), ("device", False)):
                        if flush:
                            plain.flush_cache()
                        got = plain.stream_generate(ids, self.opts.max_new_tokens)
                        expected = self.expected.setdefault((n, i), got.output_ids)
                        self.results.served.append(Served(row, n, got.ttft_s * 1e3,
                                                          got.cached_tokens,
                                                          got.output_ids == expected))
        finally:
            plain.stop()
        self._progress("recompute", "device")
        port = free_port()
        stored = self.server("cpu", self.config("cpu", disk=True, redis=True, metrics=port))
        try:
            self.serve(stored, None)  # computes and stores every prompt
            self.serve(stored, "cpu")
            self.results.hit_pieces_ms = _pieces(scrape_metrics(port))
            stored.flush_cache()  # lands the disk and Redis writes
        finally:
            stored.stop()
        self._progress("cpu")
        for row in ("disk", "redis"):
            server = self.server(row, self.config(row, disk=row == "disk",
                                                  redis=row == "redis", metrics=free_port()))
            try:
                self.serve(server, row)
            finally:
                server.stop()
            self._progress(row)
        self.conversation()
        self.memcpy()

    def conversation(self) -> None:
        server = self.server("turns", self.config("turns", disk=False, redis=True,
                                                  metrics=free_port()))
        try:
            history: list[int] = []
            before = 0
            for turn in range(1, self.opts.turns + 1):
                history = history + _prompt(f"turn-{turn}", self.opts.turn_len)
                server.flush_cache()
                got = server.stream_generate(history, 64)
                self.results.turns.append(Turn(turn, len(history), got.cached_tokens, before,
                                               got.ttft_s * 1e3))
                before = len(history) + len(got.output_ids)
                history = history + got.output_ids
        finally:
            server.stop()

    def memcpy(self) -> None:
        """Median time of one copy of each row's loaded KV bytes, in this process."""
        kv = kv_bytes_per_token(self.spec)
        for s in self.results.served:
            n = s.cached_tokens
            if n and n not in self.results.memcpy_ms:
                src = torch.empty(n * kv, dtype=torch.uint8).fill_(1)
                dst = torch.empty_like(src).fill_(0)
                times = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    dst.copy_(src)
                    times.append(time.perf_counter() - t0)
                self.results.memcpy_ms[n] = statistics.median(times) * 1e3

    def _progress(self, *rows: str) -> None:
        for row in rows:
            for n in self.opts.lengths:
                ttft = [s.ttft_ms for s in self.results.served if s.row == row and s.length == n]
                print(f"  {row:<9} {n:>6} tokens: median TTFT {statistics.median(ttft):7.1f} ms",
                      flush=True)


def _pieces(metrics: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per `kvtier_hit_seconds` piece."""
    out = {}
    for piece in PIECES:
        label = f'{{piece="{piece}"}}'
        total = metrics.get(f"kvtier_hit_seconds_sum{label}")
        count = metrics.get(f"kvtier_hit_seconds_count{label}")
        if total is not None and count:
            out[piece] = total / count * 1e3
    return out


def summarize(res: Results, lengths: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for n in lengths:
        device = [s.ttft_ms for s in res.served if s.row == "device" and s.length == n]
        for row in ROWS:
            got = [s for s in res.served if s.row == row and s.length == n]
            if not got:
                continue
            ttft = [s.ttft_ms for s in got]
            cached = int(statistics.median(s.cached_tokens for s in got))
            rows.append({
                "length": n, "row": row, "requests": len(got),
                "median_ttft_ms": statistics.median(ttft), "p99_ttft_ms": p99(ttft),
                "median_cached_tokens": cached,
                "over_device": statistics.median(ttft) / statistics.median(device)
                if device else None,
                "memcpy_ms": res.memcpy_ms.get(cached),
                "outputs_matching": sum(s.output_matches for s in got)})
    return rows


def report(opts: Options, bench: Bench) -> dict[str, Any]:
    rows = summarize(bench.results, opts.lengths)
    print(f"\nThe same prompt again ({opts.repeats} prompts per length, model "
          f"{opts.model}, chunk {opts.chunk_size}, {opts.max_new_tokens} new token(s))")
    print("| prompt | served from | median TTFT ms | p99 TTFT ms | cached tokens "
          "| / device hit | memcpy of the KV ms | outputs as first served |\n"
          "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = "-" if r["over_device"] is None else f"{r['over_device']:.2f}x"
        memcpy = "-" if r["memcpy_ms"] is None else f"{r['memcpy_ms']:.2f}"
        print(f"| {r['length']} | {r['row']} | {r['median_ttft_ms']:.1f} | "
              f"{r['p99_ttft_ms']:.1f} | {r['median_cached_tokens']} | {ratio} | {memcpy} | "
              f"{r['outputs_matching']}/{r['requests']} |")
    print("\nkvtier CPU-tier hit, mean per piece (kvtier_hit_seconds): " + ", ".join(
        f"{k} {v:.2f} ms" for k, v in bench.results.hit_pieces_ms.items()))
    print(f"\nA {opts.turns}-turn conversation (+{opts.turn_len} tokens per turn, 64-token "
          f"answers), device cache flushed before each turn, CPU + Redis")
    print("| turn | prompt tokens | cached tokens | previous turn computed | TTFT ms |\n"
          "| ---: | ---: | ---: | ---: | ---: |")
    for t in bench.results.turns:
        print(f"| {t.turn} | {t.prompt_tokens} | {t.cached_tokens} | {t.previous_computed} "
              f"| {t.ttft_ms:.1f} |")
    return {"options": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(opts).items()},
            "model": dataclasses.asdict(bench.spec),
            "kv_bytes_per_token": kv_bytes_per_token(bench.spec), "summary": rows,
            "hit_pieces_ms": bench.results.hit_pieces_ms,
            "turns": [dataclasses.asdict(t) for t in bench.results.turns],
            "served": [dataclasses.asdict(s) for s in bench.results.served],
            "memcpy_ms": {str(k): v for k, v in bench.results.memcpy_ms.items()}}


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths: comma-separated ints, got {text!r}") \
            from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"--lengths: each at least 2, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> Options:
    d = Options()
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--lengths", type=_lengths, default=d.lengths)
    p.add_argument("--repeats", type=int, default=d.repeats, help="prompts per length")
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--turn-len", type=int, default=d.turn_len)
    p.add_argument("--model", choices=sorted(MODELS), default=d.model)
    p.add_argument("--chunk-size", type=int, default=d.chunk_size)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep configs and logs here (default: a temp dir, removed)")
    p.add_argument("--quick", action="store_true", help="--lengths 1024,4096 --repeats 2")
    ns = vars(p.parse_args(argv))
    if ns.pop("quick"):
        ns.update(lengths=(1024, 4096), repeats=2)
    opts = Options(**ns)
    if opts.repeats < 1 or opts.turns < 1 or opts.turn_len < 1:
        p.error("--repeats, --turns and --turn-len must be >= 1")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    require("bench_hit", SGLANG)
    with work_dir("hit", opts.work_dir) as work:
        bench = Bench(opts, work)
        bench.run()
        out = report(opts, bench)
    write_results("bench_hit", out)


if __name__ == "__main__":
    main()
