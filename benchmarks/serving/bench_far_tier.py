"""What a far Redis costs requests it cannot serve: a fresh kvtier server next to one without
kvtier, their requests alternated, every prompt a miss.

A far tier (`--delay-ms` per reply, `--mbps`, the delay proxy of `harness/delay_proxy.py`) must
never make a request wait for a lookup that cannot be repaid. Both servers start fresh and
serve the same `--prompts` new prompts of `--prompt-len` tokens one at a time, alternating
request by request (the host's drift hits both alike), `/flush_cache` after each; the kvtier
server stores each prompt into the far Redis, and nothing it is asked for is there. With
`--compare-root DIR`, a third server runs the kvtier checkout in DIR (the code before a
change, say) the same way, on prompts of its own (the second kvtier server's stores must not
become its hits). With `--busy`, one process spins on a core beside the servers for the whole
run (users' hosts are busy).

Reported: per server, the median and p99 request time (greedy `--max-new-tokens` tokens,
non-streaming) and their ratio to the server without kvtier in the same run.

    .venv/bin/python -m benchmarks.serving.bench_far_tier [--prompts 12]
        [--prompt-len 2740] [--delay-ms 150] [--mbps 2] [--busy] [--compare-root DIR]

Needs the SGLang CPU environment (`make sglang-env`) and `redis-server` on PATH.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import time
from pathlib import Path

import yaml

from benchmarks.common import SGLANG, require, work_dir, write_results
from harness import sglang_server
from harness.delay_proxy import DelayProxy
from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from kvtier.demo.models import make_llama

ARGS = ("--context-length", "8192", "--max-total-tokens", "16384")
ENV = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
FIRST_ID, VOCAB = 4, 430  # token ids every generated tokenizer has (0-3 are specials)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


def _spin() -> None:
    while True:
        pass


def _request(server: SGLangServer, ids: list[int], new_tokens: int) -> float:
    start = time.monotonic()
    server.post("/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}})
    took = time.monotonic() - start
    server.post("/flush_cache")
    return took


def _p99(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.99 * len(values)) - 1)]


def _servers(args: argparse.Namespace, work: Path, url: str) -> dict[str, SGLangServer]:
    model = make_llama(work / "tiny-llama")
    config = work / "kvtier.yaml"
    config.write_text(yaml.safe_dump({"chunk_size": 256, "max_local_cpu_size": 0.2,
                                      "remote_url": url}))
    kv = ["--enable-kvtier", "--kvtier-config-file", str(config)]
    arms = [("none", [], None), ("kvtier", kv, None)]
    if args.compare_root is not None:
        arms.append(("kvtier@compare", kv, args.compare_root))
    servers, base = {}, sglang_server.PYTHONPATH_DIRS
    try:
        for name, flags, root in arms:  # a checkout first on the path replaces kvtier
            sglang_server.PYTHONPATH_DIRS = (root.resolve(), *base) if root else base
            servers[name] = SGLangServer(model, work / f"{name}.log", args=[*flags, *ARGS],
                                         env=ENV)
            servers[name].launch()
    finally:
        sglang_server.PYTHONPATH_DIRS = base
    for server in servers.values():
        server.wait_ready()
    return servers


def run(args: argparse.Namespace, work: Path) -> dict[str, object]:
    redis = RedisProcess(work / "redis")
    redis.start()
    busy = multiprocessing.Process(target=_spin, daemon=True) if args.busy else None
    times: dict[str, list[float]] = {}
    try:
        with DelayProxy(redis.port, args.delay_ms / 1e3, bytes_per_s=args.mbps * 1e6) as proxy:
            servers = _servers(args, work, proxy.url)
            try:
                if busy is not None:
                    busy.start()
                for i in range(args.prompts):
                    for n, (name, server) in enumerate(servers.items()):
                        own = 1000 * (n if name == "kvtier@compare" else 0)
                        ids = prompt(7000 + own + i, args.prompt_len)
                        times.setdefault(name, []).append(
                            _request(server, ids, args.max_new_tokens))
            finally:
                for server in servers.values():
                    server.stop()
    finally:
        if busy is not None and busy.pid is not None:
            busy.kill()
        redis.stop()
    base = statistics.median(times["none"])
    rows = {name: {"median_s": statistics.median(t), "p99_s": _p99(t),
                   "median_ratio": statistics.median(t) / base,
                   "p99_ratio": _p99(t) / _p99(times["none"]), "times_s": t}
            for name, t in times.items()}
    return {"prompts": args.prompts, "prompt_len": args.prompt_len, "delay_ms": args.delay_ms,
            "mbps": args.mbps, "busy": args.busy, "servers": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--prompt-len", type=int, default=2740)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--delay-ms", type=float, default=150.0)
    p.add_argument("--mbps", type=float, default=2.0)
    p.add_argument("--busy", action="store_true", help="one process spinning beside the servers")
    p.add_argument("--compare-root", type=Path, default=None,
                   help="a kvtier checkout to run as a third server (e.g. the code before)")
    p.add_argument("--work-dir", type=Path, default=None)
    args = p.parse_args(argv)
    require("bench_far_tier", SGLANG)
    if args.prompts < 1:
        p.error(f"--prompts must be >= 1, got {args.prompts}")
    with work_dir("far-tier", args.work_dir) as work:
        result = run(args, work)
    print(f"\n{args.prompts} new prompts of {args.prompt_len} tokens, Redis +{args.delay_ms:g} ms "
          f"per reply at {args.mbps:g} MB/s{', one busy process beside' if args.busy else ''}")
    print("| server | median s | p99 s | median / none | p99 / none |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    for name, row in result["servers"].items():  # type: ignore[union-attr]
        print(f"| {name} | {row['median_s']:.3f} | {row['p99_s']:.3f} "
              f"| {row['median_ratio']:.2f}x | {row['p99_ratio']:.2f}x |")
    write_results("far_tier" + ("_busy" if args.busy else ""), result)


if __name__ == "__main__":
    main()
