"""Does a load from a slow tier stall the requests already running? Real SGLang, on CPU.

A tiny Llama (4 layers) serves a streaming request; while it streams, a request whose long
prompt (`--prompt-tokens`) was stored in Redis by another server arrives. This server reaches
Redis through a proxy that delays every reply by `--delay-ms` (a remote Redis). Measured per
mode: the stream's median and worst inter-token gap while the long request is in flight, the
long request's TTFT and its cached tokens.

Modes: `no kvtier` (the long prompt is recomputed), `kvtier` (loads run in the background
through SGLang's prefetch hooks, policy wait_complete: the load is always waited for),
`kvtier, adaptive` (the same with the default policy, which loads only what arrives sooner than
it recomputes), and `kvtier, no CPU tier` (`local_cpu: false`, where loads still run on the
scheduler thread: the old behaviour).

    .venv/bin/python -m benchmarks.serving.bench_stall [--delay-ms 150]
        [--prompt-tokens 2700] [--chunk-size 64] [--fresh-kernel]

`--fresh-kernel` gives every server an empty `KVTIER_CACHE_DIR`, so each kvtier server compiles
the copy kernel while it starts (a freshly deployed host).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import SGLANG, require
from harness.delay_proxy import DelayProxy
from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from kvtier.demo.models import make_llama

RESULTS = Path(__file__).resolve().parents[1] / "results"
FLAGS = ("--context-length", "8192", "--max-total-tokens", "16384")
CHUNK = 64
ENV = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 430) for _ in range(n)]


def measure(server: SGLangServer, long_ids: list[int]) -> dict[str, float]:
    times: list[float] = []
    streamer = threading.Thread(target=server.stream_generate, args=(_ids(99, 64), 1500),
                                kwargs={"on_chunk": lambda: times.append(time.monotonic())})
    streamer.start()
    while len(times) < 50:
        time.sleep(0.01)
    sent = time.monotonic()
    long = server.stream_generate(long_ids)
    answered = time.monotonic()
    streamer.join()
    gaps = [b - a for a, b in zip(times[5:], times[6:])]
    during = [b - a for a, b in zip(times, times[1:]) if b >= sent and a <= answered]
    return {"median_gap_ms": statistics.median(gaps) * 1e3, "worst_gap_ms": max(during) * 1e3,
            "long_ttft_ms": long.ttft_s * 1e3, "cached_tokens": long.cached_tokens,
            "prompt_tokens": len(long_ids)}


def _config(path: Path, url: str, chunk: int, **extra: Any) -> Path:
    path.write_text(yaml.safe_dump({"chunk_size": chunk, "max_local_cpu_size": 0.5,
                                    "remote_url": url, "remote_timeout_secs": 10.0, **extra}))
    return path


def run(delay_ms: float, prompt_tokens: int, work: Path, chunk: int = CHUNK,
        fresh_kernel: bool = False) -> dict[str, dict[str, float]]:
    model = make_llama(work / "tiny-llama-4l", layers=4)
    long_ids = _ids(7, prompt_tokens)
    redis = RedisProcess(work / "redis")
    redis.start()
    out: dict[str, dict[str, float]] = {}
    try:
        with SGLangServer(model, work / "store.log", env=ENV, args=[
                "--enable-kvtier", "--kvtier-config-file",
                str(_config(work / "a.yaml", redis.url, chunk)), *FLAGS]) as store:
            store.generate(long_ids)
            store.flush_cache()
        modes = {"no kvtier": None,
                 "kvtier": {"prefetch_policy": "wait_complete"},
                 "kvtier, adaptive": {},  # the default policy: load only what beats recompute
                 "kvtier, no CPU tier": {"local_cpu": False, "max_local_cpu_size": 0.5}}
        with DelayProxy(redis.port, delay_ms / 1e3) as proxy:
            for name, extra in modes.items():
                flags = [] if extra is None else ["--enable-kvtier", "--kvtier-config-file", str(
                    _config(work / f"{len(out)}.yaml", proxy.url, chunk, **extra))]
                env = dict(ENV)
                if fresh_kernel:
                    env["KVTIER_CACHE_DIR"] = str(work / f"kernel-cache-{len(out)}")
                with SGLangServer(model, work / f"{len(out)}.log", env=env,
                                  args=[*flags, *FLAGS]) as server:
                    out[name] = measure(server, long_ids)
                print(f"  {name}: {out[name]}", flush=True)
    finally:
        redis.stop()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=150.0)
    parser.add_argument("--prompt-tokens", type=int, default=2700)
    parser.add_argument("--chunk-size", type=int, default=CHUNK)
    parser.add_argument("--fresh-kernel", action="store_true",
                        help="an empty KVTIER_CACHE_DIR per server: each compiles the kernel")
    args = parser.parse_args(argv)
    require("bench_stall", SGLANG)
    with tempfile.TemporaryDirectory(prefix="kvtier-stall-") as tmp:
        out = run(args.delay_ms, args.prompt_tokens, Path(tmp), args.chunk_size,
                  args.fresh_kernel)
    print(f"\nstream gaps while a {args.prompt_tokens}-token cached prompt arrives "
          f"(Redis replies +{args.delay_ms:.0f} ms)")
    print(f"{'mode':<22}{'median gap':>11}{'worst gap':>11}{'worst/median':>13}"
          f"{'long TTFT':>11}{'cached':>8}")
    for name, r in out.items():
        print(f"{name:<22}{r['median_gap_ms']:>9.1f}ms{r['worst_gap_ms']:>9.1f}ms"
              f"{r['worst_gap_ms'] / r['median_gap_ms']:>13.1f}{r['long_ttft_ms']:>9.0f}ms"
              f"{r['cached_tokens']:>8}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "bench_stall.json"
    path.write_text(json.dumps({"delay_ms": args.delay_ms, "chunk_size": args.chunk_size,
                                "fresh_kernel": args.fresh_kernel, "modes": out}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
