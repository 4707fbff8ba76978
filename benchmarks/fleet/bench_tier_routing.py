"""Routing that knows kvtier's tiers: a multi-turn workload across N servers behind SMG.

`--servers` (default 2) real SGLang servers with kvtier (its CPU tier, and one shared
redis-server) on a generated Llama, each with a device pool smaller than the workload's working
set (`--max-total-tokens`), serve `--conversations` conversations of `--turns` turns (each
turn: the whole history, then `--turn-len` new tokens; round by round, every conversation's
turn t before any turn t+1, `--concurrency` requests at a time) through SMG (`smg launch`)
with, in this order, each on fresh servers and a flushed Redis:

    round_robin      SMG round_robin over gRPC workers: the baseline
    cache_aware/tree SMG cache_aware over HTTP workers: its approximate tree, no KV events
    cache_aware/device  SMG cache_aware over gRPC workers publishing SGLang's device events
                     only (`tier_events: false`): routing without kvtier's tiers
    cache_aware/events  SMG cache_aware over gRPC workers publishing KV events: the device's
                     and kvtier's tiers (CPU_PINNED, EXTERNAL), relayed by smg-grpc-servicer

Reported per run: mean and p99 TTFT (streamed, as the client sees it) and the share of prompt
tokens each source served (the device cache; kvtier's CPU tier and Redis, from the servers'
`hit_chunks` counters, scaled to the tokens kvtier loaded; the rest computed), each also as a
ratio to round_robin's in the same run.

    .venv/bin/python -m benchmarks.fleet.bench_tier_routing            # ~10 min on 2 cores

Prints a table and writes benchmarks/results/bench_tier_routing.json. Needs `make sglang-env`,
the fleet extra and `redis-server`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import work_dir, write_results
from benchmarks.fleet.gateway import Gateway, make_grpc_worker, wait_grpc_ready, worker_url
from benchmarks.fleet.runs import tier_counters
from harness.redis import RedisProcess
from kvtier.demo.models import LlamaSpec, make_llama
from kvtier.demo.server import CPU_FLAGS, SGLangServer, cpu_shims_dir, free_port

# (name, SMG policy, gRPC workers, kvtier's tier events)
ARMS = (("round_robin", "round_robin", True, True),
        ("cache_aware/tree", "cache_aware", False, True),
        ("cache_aware/device", "cache_aware", True, False),
        ("cache_aware/events", "cache_aware", True, True))


@dataclasses.dataclass
class Options:
    servers: int = 2
    conversations: int = 8
    turns: int = 4
    first_len: int = 512
    turn_len: int = 96
    output_len: int = 16
    concurrency: int = 2
    max_total_tokens: int = 1536  # each device pool: about 2 conversations of the 8
    chunk_size: int = 64
    max_local_cpu_size: float = 0.03  # GB of CPU tier per server
    hidden: int = 512  # 16 KB of KV a token: the working set ~120 MB, a CPU tier ~2 conversations
    layers: int = 8
    threads: int = 1
    seed: int = 1
    work_dir: Path | None = None


def stream_generate(url: str, model: Path, ids: list[int], max_new: int) -> dict[str, Any]:
    """One streamed greedy `/generate` through the gateway: ttft_s, output_ids, cached."""
    body = {"model": str(model), "input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new,
                                "ignore_eos": True}}
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    first: float | None = None
    chunks: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:300])
            if chunk.get("output_ids"):
                first = first if first is not None else time.perf_counter()
                chunks.append(chunk)
    if first is None:
        raise RuntimeError("the stream carried no output token")
    last = chunks[-1]
    # SGLang streams the output so far; SMG over gRPC streams increments, and its closing
    # chunk repeats the last token: the first max_new of them are the answer.
    out = list(last["output_ids"]) if len(last["output_ids"]) == max_new else \
        [i for c in chunks for i in c["output_ids"]][:max_new]
    meta = next((c["meta_info"] for c in reversed(chunks) if c.get("meta_info")), {})
    return {"ttft_s": first - sent, "output_ids": out,
            "cached": int(meta.get("cached_tokens", 0)), "prompt": len(ids)}


def drive(url: str, model: Path, opts: Options) -> list[dict[str, Any]]:
    """Rounds: in round t every conversation sends its turn t (`concurrency` at a time, in
    conversation order), and round t+1 starts once round t answered. Between two turns of one
    conversation come the other conversations' turns, so the working set is all of them (the
    device pools hold a fraction). The records of every request."""
    rng = random.Random(opts.seed)
    histories = [[rng.randrange(4, 430) for _ in range(opts.first_len)]
                 for _ in range(opts.conversations)]
    records: list[dict[str, Any]] = []

    def turn(conv: int, t: int) -> None:
        rec = stream_generate(url, model, histories[conv], opts.output_len)
        records.append({**rec, "conversation": conv, "turn": t})
        more = random.Random(opts.seed * 1000 + conv * 100 + t)
        histories[conv] += rec["output_ids"] + [more.randrange(4, 430)
                                                for _ in range(opts.turn_len)]

    with ThreadPoolExecutor(opts.concurrency) as pool:
        for t in range(opts.turns):
            for done in [pool.submit(turn, conv, t) for conv in range(opts.conversations)]:
                done.result()  # a failed request stops the run: its history would be wrong
    return records


def start_servers(opts: Options, work: Path, model: Path, redis: RedisProcess, tag: str,
                  grpc: bool, tier_events: bool = True) -> tuple[list[SGLangServer], list[int]]:
    servers, ports = [], []
    for i in range(opts.servers):
        ports.append(free_port())
        config = work / f"{tag}-{i}.yaml"
        config.write_text(yaml.safe_dump({
            "chunk_size": opts.chunk_size, "max_local_cpu_size": opts.max_local_cpu_size,
            "remote_url": redis.url, "metrics_port": ports[-1], "tier_events": tier_events}))
        server = SGLangServer(model, work / f"{tag}-{i}.log", args=[
            "--max-total-tokens", str(opts.max_total_tokens), "--page-size", "16",
            "--enable-kvtier", "--kvtier-config-file", str(config)],
            env={"OMP_NUM_THREADS": str(opts.threads), "KVTIER_CACHE_DIR": str(work / "kernel")},
            pythonpath=[cpu_shims_dir()], cpu_flags=CPU_FLAGS)
        servers.append(make_grpc_worker(server) if grpc else server)
    for server in servers:
        server.launch()
    for server in servers:
        wait_grpc_ready(server) if grpc else server.wait_ready()
    return servers, ports


def summarize(records: list[dict[str, Any]], counters: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in records if not math.isnan(r["ttft_s"])]
    ttfts = sorted(r["ttft_s"] for r in ok)
    prompt = sum(r["prompt"] for r in ok)
    cached = sum(r["cached"] for r in ok)
    loaded = counters.get("tokens_loaded", 0.0)
    hits = {t: counters.get(f"{t}.hit_chunks", 0.0) for t in ("cpu", "redis")}
    per_chunk = loaded / sum(hits.values()) if sum(hits.values()) else 0.0
    shares = {"device": max(0.0, cached - loaded) / prompt,
              **{t: n * per_chunk / prompt for t, n in hits.items()}}
    shares["computed"] = max(0.0, 1.0 - sum(shares.values()))
    p99 = ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)]
    return {"requests": len(records), "mean_ttft_s": statistics.fmean(ttfts),
            "p99_ttft_s": p99, "shares": shares}


def run_arm(opts: Options, work: Path, model: Path, redis: RedisProcess,
            arm: tuple[str, str, bool, bool]) -> dict[str, Any]:
    name, policy, grpc, tier_events = arm
    print(f"{name}: {opts.servers} servers, SMG {policy}, "
          f"{'gRPC workers with KV events' if grpc else 'HTTP workers'}", flush=True)
    redis.client().flushall()
    tag = name.replace("/", "-")
    servers, ports = start_servers(opts, work, model, redis, tag, grpc, tier_events)
    try:
        gateway = Gateway("smg", [worker_url(s, grpc) for s in servers], policy,
                          work / f"{tag}.smg.log", model=model)
        try:
            records = drive(gateway.url, model, opts)
        finally:
            gateway.stop()
        return {"name": name, "policy": policy, "grpc": grpc, "tier_events": tier_events,
                **summarize(records, tier_counters(ports))}
    finally:
        for server in servers:
            server.stop()


def report(opts: Options, arms: list[dict[str, Any]]) -> dict[str, Any]:
    base = arms[0]
    print(f"\n{opts.servers} servers, {opts.conversations} conversations x {opts.turns} turns, "
          f"device pool {opts.max_total_tokens} tokens each; ratios to {base['name']}")
    print("| run | mean TTFT s | vs rr | p99 TTFT s | vs rr | device | cpu | redis | computed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for a in arms:
        a["mean_vs_rr"] = a["mean_ttft_s"] / base["mean_ttft_s"]
        a["p99_vs_rr"] = a["p99_ttft_s"] / base["p99_ttft_s"]
        a["shares_vs_rr"] = {k: (v / base["shares"][k] if base["shares"][k] else None)
                             for k, v in a["shares"].items()}
        sh = a["shares"]
        print(f"| {a['name']} | {a['mean_ttft_s']:.3f} | {a['mean_vs_rr']:.2f} | "
              f"{a['p99_ttft_s']:.3f} | {a['p99_vs_rr']:.2f} | {sh['device']:.2f} | "
              f"{sh['cpu']:.2f} | {sh['redis']:.2f} | {sh['computed']:.2f} |")
    return {"options": dataclasses.asdict(opts), "arms": arms}


def parse_args(argv: list[str] | None = None) -> Options:
    d = Options()
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    for f in dataclasses.fields(Options):
        if f.name != "work_dir":
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(d, f.name)),
                           default=getattr(d, f.name))
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep models, configs and logs here (default: a temp dir, removed)")
    return Options(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    with work_dir("tier-routing", opts.work_dir) as work:
        context = opts.first_len + opts.turns * (opts.turn_len + opts.output_len) + 64
        model = make_llama(work / "model", spec=LlamaSpec(
            hidden=opts.hidden, layers=opts.layers, intermediate=2 * opts.hidden,
            max_positions=max(2048, context)))
        redis = RedisProcess(work / "redis")
        redis.start()
        try:
            arms = [run_arm(opts, work, model, redis, arm) for arm in ARMS]
        finally:
            redis.stop()
    write_results("bench_tier_routing", report(opts, arms))


if __name__ == "__main__":
    main()
