"""Does a hit change what the model says? The quality gate over many prompts, on a real model.

SmolLM2-135M-Instruct (trained weights, float32; `make sglang-env` converts it once) on real
SGLang servers on CPU. A reference server without kvtier and without SGLang's prefix cache
computes every prompt from scratch. A kvtier server (CPU + disk + Redis) serves each prompt
once (`miss`: the same computation, kvtier only stores), then again after `/flush_cache`
(`cpu`); a restarted server on its disk (`disk`) and a second instance on its Redis (`redis`)
serve them once more. Every answer is compared with the reference (kvtier/demo/quality.py):
identical greedy tokens, |delta logprob| of the first 16 tokens, KL of the first token's top-20.

The `miss` row is the baseline measured in the same run: the honest spread between two
computations of the same prompt. Each hit row reports its p99 |delta logprob| as a ratio to it.
With `--verify`, each kvtier server then switches shadow verification on (`verify_fraction`
1.0, over the admin route) and serves every prompt again: computed, not loaded, and compared
with the records of its tiers (`cpu+verify`: the first server's CPU tier, disk and Redis;
`disk+verify`: the restarted server's, records written before the restart; `redis+verify`: the
second instance's, no CPU tier); those rows add the chunks verified and the mismatches.
With `--serde fp8` the kvtier servers store disk and Redis records with that codec
(`remote_serde`; the CPU tier stays exact), and each row adds the codec gate (docs/codecs.md):
identical greedy answers at least `GATE_IDENTICAL` of the prompts (48 of 50) and every
first-token top-20 KL at most `GATE_KL`; the `disk` and `redis` rows are the codec's.
`KL16` is the top-20 KL averaged over the first 16 output tokens (the positions both answers
reached by the same tokens), then over the prompts.
Prints a table, writes benchmarks/results/bench_quality.json (`bench_quality-fp8.json`, ...).

    .venv/bin/python -m benchmarks.serving.bench_quality [--prompts 50] [--facts 24]
        [--tp 1] [--page-size 16] [--chunk-size 64] [--verify] [--serde naive|fp8]

Needs the SGLang CPU environment (`make sglang-env`) and `redis-server` on PATH.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import SGLANG, real_model, work_dir, write_results
from benchmarks.serving.adaptive_report import p99
from harness.redis import RedisProcess
from kvtier.cli.tiers import request
from kvtier.demo.quality import (
    KL_LIMIT,
    LOGPROB_TOLERANCE,
    Agreement,
    Answer,
    ask,
    compare,
    documents,
)
from kvtier.demo.server import CPU_FLAGS, SGLangServer, cpu_shims_dir
from kvtier.integration.sglang.launch.cpu import BIND_ENV, thread_binds

PATHS = ("miss", "cpu", "disk", "redis")
GATE_IDENTICAL = 0.96  # of the prompts' greedy answers identical to the reference (48 of 50)
GATE_KL = 0.01  # the largest first-token top-20 KL a codec may add
ADMIN = "bench-quality-admin"
VERIFIED = re.compile(r"kvtier: verified (\d+) chunks .*?: (\d+) mismatched \(largest relative "
                      r"error ([0-9.eE+-]+)\)")


def _server(model: Path, work: Path, name: str, args: list[str],
            env: dict[str, str] | None = None, **config: Any) -> SGLangServer:
    flags = [*args, "--max-total-tokens", "8192"]
    if config:
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"prefetch_policy": "wait_complete", **config}))
        flags += ["--enable-kvtier", "--kvtier-config-file", str(path), "--admin-api-key",
                  ADMIN]
    else:
        flags.append("--disable-radix-cache")
    return SGLangServer(model, work / f"{name}.log", args=flags, env=env,
                        pythonpath=[cpu_shims_dir()], cpu_flags=CPU_FLAGS)


def _serve_all(server: SGLangServer, prompts: list[str]) -> list[Answer]:
    return [ask(server, text) for text in prompts]


def _verify_all(server: SGLangServer, prompts: list[str], tp: int,
                ) -> tuple[list[Answer], dict[str, float]]:
    """Every prompt again with shadow verification on: (the answers, chunks verified,
    mismatches and the largest relative error over every rank)."""
    status, answer = request(server.url, {"op": "verify", "fraction": 1.0}, ADMIN)
    if status != 200:
        raise RuntimeError(f"verify_fraction 1.0 refused: {status} {answer}")
    server.flush_cache()
    mark = len(server.log())
    answers = _serve_all(server, prompts)
    deadline = time.monotonic() + 120  # the store thread logs after the last reply
    while len(found := VERIFIED.findall(server.log()[mark:])) < tp * len(prompts):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(found)} of {tp * len(prompts)} verifications logged")
        time.sleep(0.1)
    return answers, {"chunks": sum(int(n) for n, _, _ in found),
                     "mismatches": sum(int(m) for _, m, _ in found),
                     "max_error": max(float(e) for _, _, e in found)}


def _row(path: str, agreements: list[Agreement], answers: list[Answer],
         spread_p99: float | None) -> dict[str, Any]:
    deltas = [a.max_delta for a in agreements]
    row = {"path": path, "prompts": len(agreements),
           "identical": sum(a.identical for a in agreements) / len(agreements),
           "max_dlogprob": max(deltas), "p99_dlogprob": p99(deltas),
           "median_dlogprob": statistics.median(deltas),
           "mean_kl": statistics.fmean(a.kl for a in agreements),
           "max_kl": max(a.kl for a in agreements),
           "mean_kl16": statistics.fmean(a.mean_kl for a in agreements),
           "hit_tokens": sum(a.cached_tokens for a in answers),
           "prompt_tokens": sum(a.prompt_tokens for a in answers),
           "pass": all(a.ok for a in agreements),
           "identical_count": sum(a.identical for a in agreements)}
    row["gate"] = (row["identical"] >= GATE_IDENTICAL and row["max_kl"] <= GATE_KL)
    row["p99_vs_miss"] = (row["p99_dlogprob"] / spread_p99) if spread_p99 else None
    return row


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = real_model("bench_quality", SGLANG)
    prompts = documents(args.prompts, facts=args.facts, seed=1)
    shape = ["--tp", str(args.tp), "--page-size", str(args.page_size)]
    env = {BIND_ENV: thread_binds(args.tp)} if args.tp > 1 else {}
    tiers = {"chunk_size": args.chunk_size, "max_local_cpu_size": 1.0,
             "remote_serde": args.serde,  # measured even where its gate failed before:
             "remote_serde_override": args.serde != "naive"}
    redis = RedisProcess(work / "redis")
    redis.start()
    disk = str(work / "disk")
    answers: dict[str, list[Answer]] = {}
    checks: dict[str, dict[str, float]] = {}
    try:
        with _server(model, work, "reference", []) as reference:
            answers["reference"] = _serve_all(reference, prompts)
        with _server(model, work, "first", shape, env, local_disk=disk, max_local_disk_size=2.0,
                     remote_url=redis.url, **tiers) as first:
            answers["miss"] = _serve_all(first, prompts)
            first.flush_cache()
            answers["cpu"] = _serve_all(first, prompts)
            if args.verify:
                answers["cpu+verify"], checks["cpu+verify"] = _verify_all(first, prompts, args.tp)
        with _server(model, work, "restarted", shape, env, local_disk=disk,
                     max_local_disk_size=2.0, **tiers) as restarted:
            answers["disk"] = _serve_all(restarted, prompts)
            if args.verify:
                answers["disk+verify"], checks["disk+verify"] = _verify_all(restarted, prompts,
                                                                            args.tp)
        with _server(model, work, "second", shape, env, remote_url=redis.url,
                     **{**tiers, "local_cpu": False}) as second:
            answers["redis"] = _serve_all(second, prompts)
            if args.verify:
                answers["redis+verify"], checks["redis+verify"] = _verify_all(second, prompts,
                                                                              args.tp)
    finally:
        redis.stop()
    rows, spread = [], None
    for path in [p for p in answers if p != "reference"]:
        agreements = [compare(ref, got) for ref, got in zip(answers["reference"], answers[path],
                                                            strict=True)]
        rows.append({**_row(path, agreements, answers[path], spread), **checks.get(path, {})})
        spread = spread if spread is not None else rows[0]["p99_dlogprob"]
    return {"model": model.name, "tp": args.tp, "page_size": args.page_size,
            "serde": args.serde, "gate": {"identical": GATE_IDENTICAL, "kl": GATE_KL},
            "chunk_size": args.chunk_size, "facts": args.facts,
            "bounds": {"logprob": LOGPROB_TOLERANCE, "kl": KL_LIMIT}, "rows": rows,
            "sample": {"prompt_tail": prompts[0][-120:], "answer": answers["cpu"][0].text}}


def print_table(result: dict[str, Any]) -> None:
    print(f"\nquality on {result['model']}, TP {result['tp']}, page {result['page_size']}, "
          f"chunk {result['chunk_size']}, remote_serde {result['serde']} (bounds: |dlogprob| <= "
          f"{LOGPROB_TOLERANCE}, KL <= {KL_LIMIT}; codec gate: identical >= {GATE_IDENTICAL}, "
          f"first-token KL <= {GATE_KL})")
    print(f"{'path':12} {'prompts':>7} {'hit tok':>8} {'identical':>9} {'max |dlp|':>10} "
          f"{'p99 |dlp|':>10} {'x miss':>7} {'mean KL':>9} {'max KL':>9} {'KL16':>9} pass gate")
    for r in result["rows"]:
        ratio = f"{r['p99_vs_miss']:.2f}" if r["p99_vs_miss"] is not None else "-"
        verified = (f"  verified {r['chunks']} chunks: {r['mismatches']} mismatched, largest "
                    f"error {r['max_error']:.3g}" if "chunks" in r else "")
        print(f"{r['path']:12} {r['prompts']:>7} {r['hit_tokens']:>8} {r['identical']:>9.2f} "
              f"{r['max_dlogprob']:>10.2e} {r['p99_dlogprob']:>10.2e} {ratio:>7} "
              f"{r['mean_kl']:>9.2e} {r['max_kl']:>9.2e} {r['mean_kl16']:>9.2e} "
              f"{r['pass']!s:5} {r['gate']}"
              f"{verified}")
    print(f"sample answer: {result['sample']['answer']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--facts", type=int, default=24, help="inventory lines a prompt holds")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--verify", action="store_true", help="then serve every prompt again "
                        "with shadow verification on, on each kvtier server")
    parser.add_argument("--serde", choices=("naive", "fp8", "int8"), default="naive",
                        help="remote_serde of the kvtier servers' disk and Redis records")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    with work_dir("quality", args.work_dir) as work:
        result = run(args, work)
    print_table(result)
    write_results("bench_quality" + ("" if args.serde == "naive" else f"-{args.serde}"),
                  result)


if __name__ == "__main__":
    main()
