"""Token gaps of a running stream while an admin attaches a Redis tier that never answers.

An attach builds the tier (connect, ping) on a thread of its own, so a stream that is decoding
meanwhile should not notice it. One real SGLang server (a generated Llama, CPU flags as in the
demo, `--admin-api-key`) declares a Redis reached through a loopback proxy; the Redis tier is
detached, the proxy turned into a tarpit (it accepts and never answers), and then, per round:

    baseline   a `--tokens`-token stream alone
    attach     the same stream, with `kvtier tiers attach redis` sent after its first tokens
               (it fails once the connect timeout, `--timeout` s, runs out)

The gap between consecutive streamed chunks is measured on the client. The table shows, per
case, the median, p99 and largest gap over all rounds, and the attach case's ratios to the
baseline's. It also shows whether every attach failed as it should.

    .venv/bin/python -m benchmarks.fleet.bench_attach [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.common import work_dir, write_results
from harness.delay_proxy import DelayProxy
from harness.redis import RedisProcess
from kvtier.cli import main as kvtier_main
from kvtier.demo.models import LlamaSpec, make_llama
from kvtier.demo.server import CPU_FLAGS, SGLangServer, cpu_shims_dir, gpu_available

ADMIN = "bench-attach-admin"
VOCAB = range(4, 430)  # ids every generated tokenizer has


@dataclass
class Case:
    name: str
    gaps_ms: list[float] = field(default_factory=list)
    attach_rc: list[int] = field(default_factory=list)
    attach_s: list[float] = field(default_factory=list)

    def stats(self) -> dict[str, float]:
        g = np.array(self.gaps_ms)
        return {"median_ms": float(np.median(g)), "p99_ms": float(np.percentile(g, 99)),
                "max_ms": float(g.max()), "gaps": len(g)}


def stream(server: SGLangServer, ids: list[int], tokens: int,
           started: threading.Event | None = None) -> list[float]:
    """Gaps (ms) between the chunks of one streamed generation; sets `started` after the
    third chunk."""
    stamps: list[float] = []

    def on_chunk() -> None:
        stamps.append(time.perf_counter())
        if started is not None and len(stamps) == 3:
            started.set()

    server.stream_generate(ids, tokens, on_chunk=on_chunk)
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]


def attach_during(server: SGLangServer, ids: list[int], tokens: int, case: Case) -> None:
    started = threading.Event()
    gaps: list[float] = []
    t = threading.Thread(target=lambda: gaps.extend(stream(server, ids, tokens, started)))
    t.start()
    started.wait(120)
    t0 = time.monotonic()
    rc = kvtier_main(["tiers", "--server", server.url, "--admin-key", ADMIN, "attach", "redis"])
    case.attach_s.append(time.monotonic() - t0)
    case.attach_rc.append(rc)
    t.join()
    case.gaps_ms += gaps


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = make_llama(work / "model", spec=LlamaSpec(hidden=512, layers=8, intermediate=1024,
                                                      max_positions=4096))
    redis = RedisProcess(work / "redis")
    redis.start()
    cases = {"baseline": Case("baseline"), "attach": Case("attach")}
    try:
        with DelayProxy(redis.port, 0.0) as proxy:
            config = work / "kvtier.yaml"
            config.write_text(yaml.safe_dump({"remote_url": proxy.url,
                                              "remote_timeout_secs": args.timeout}))
            server = SGLangServer(
                model, work / "server.log",
                args=["--enable-kvtier", "--kvtier-config-file", str(config),
                      "--admin-api-key", ADMIN],
                env={"KVTIER_CACHE_DIR": str(work / "kernel")},
                pythonpath=[] if gpu_available() else [cpu_shims_dir()], cpu_flags=CPU_FLAGS)
            with server:  # started here, stopped at the end
                assert kvtier_main(["tiers", "--server", server.url, "--admin-key", ADMIN,
                                    "detach", "redis"]) == 0
                proxy.delay_s = 3600.0  # accepts, never answers in time
                ids = [VOCAB[(7 * i) % len(VOCAB)] for i in range(args.prompt)]
                stream(server, ids, 16)  # warm-up
                for r in range(args.rounds):
                    print(f"round {r + 1}/{args.rounds}", flush=True)
                    cases["baseline"].gaps_ms += stream(server, ids, args.tokens)
                    attach_during(server, ids, args.tokens, cases["attach"])
    finally:
        redis.stop()
    return report(args, cases)


def report(args: argparse.Namespace, cases: dict[str, Case]) -> dict[str, Any]:
    base, att = cases["baseline"].stats(), cases["attach"].stats()
    print(f"\ntoken gaps of a {args.tokens}-token stream, {args.rounds} rounds; attach to a "
          f"tarpit Redis (connect timeout {args.timeout} s) during the second stream")
    print("| case | gaps | median ms | p99 ms | max ms |\n| --- | ---: | ---: | ---: | ---: |")
    for name, s in (("baseline", base), ("attach", att)):
        print(f"| {name} | {s['gaps']} | {s['median_ms']:.1f} | {s['p99_ms']:.1f} "
              f"| {s['max_ms']:.1f} |")
    ratios = {k: att[k] / base[k] for k in ("median_ms", "p99_ms", "max_ms")}
    a = cases["attach"]
    print(f"attach / baseline: median {ratios['median_ms']:.2f}x, p99 {ratios['p99_ms']:.2f}x, "
          f"max {ratios['max_ms']:.2f}x")
    print(f"attach exit codes {a.attach_rc} (1 = refused, as it should be); attach took "
          f"{statistics.median(a.attach_s):.1f} s (median)")
    return {"args": vars(args), "baseline": base, "attach": att, "ratios": ratios,
            "attach_rc": a.attach_rc, "attach_s": a.attach_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=300, help="tokens per stream")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--timeout", type=float, default=2.0, help="remote_timeout_secs")
    p.add_argument("--work-dir", type=Path, default=None)
    args = p.parse_args(argv)
    with work_dir("attach", args.work_dir) as work:
        out = run(args, work)
    write_results("bench_attach", out)


if __name__ == "__main__":
    main()
