"""What does shadow verification cost, and how far apart are two honest computations?

One kvtier server (SmolLM2-135M-Instruct, float32, CPU + disk tiers) serves `--prompts`
documents once, one at a time (misses: kvtier stores them). Then rounds of the same prompts,
sent by `--clients` concurrent clients after `/flush_cache`, so every request is a CPU-tier hit,
or, when verified, a prefill computed in a batch with the others and compared with the record
that was computed alone. A round sends the prompts `--repeat` times over: a share of 0.01 needs
a few hundred requests per round to verify any. SGLang's device pool (`--max-total-tokens`, by
default about 6 prompts) holds fewer than the prompts, so it never holds the next one: a request
SGLang found in its own pool would be neither loaded nor verified. Each round runs once per
verification share in `--fractions`, switched at run time on the same server (the admin route
`kvtier verify` uses), interleaved round by round and in a rotating order, so the host's drift
falls on every share alike. Each share above 0 runs once per scope in `--scopes` (`full`: the
whole prompt is computed; `tail`: the prefix loads and the hit's last full chunk is computed).

Reported per share: requests per second (median and p99 of the per-round rates) as a ratio to
verification off in the same run (of the medians, and the median of each round's ratio to the
baseline's round beside it), requests and chunks verified, mismatches, and the largest
relative error an honest record showed (what the tolerance in kvtier/engine/verify.py must stay
above).
Prints a table, writes benchmarks/results/bench_verify.json.

    .venv/bin/python -m benchmarks.serving.bench_verify [--prompts 16]
        [--clients 4] [--rounds 3] [--repeat 1] [--fractions 0,0.01,1] [--scopes full,tail]

Needs the SGLang CPU environment (`make sglang-env`).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import SGLANG, real_model, work_dir, write_results
from benchmarks.serving.adaptive_report import p99
from kvtier.cli.tiers import request
from kvtier.config.schema import VERIFY_SCOPES
from kvtier.demo.quality import ask, documents
from kvtier.demo.server import CPU_FLAGS, SGLangServer, cpu_shims_dir

ADMIN = "bench-verify-admin"
VERIFIED = re.compile(r"kvtier: verified (\d+) chunks .*?: (\d+) mismatched "
                      r"\(largest relative error ([0-9.eE+-]+)\)")


def _server(work: Path, args: argparse.Namespace) -> SGLangServer:
    config = work / "kvtier.yaml"
    config.write_text(yaml.safe_dump({
        "chunk_size": args.chunk_size, "max_local_cpu_size": 1.0,
        "local_disk": str(work / "disk"), "max_local_disk_size": 2.0,
        "prefetch_policy": "wait_complete"}))
    model = real_model("bench_verify", SGLANG)
    return SGLangServer(model, work / "server.log", args=[
        "--enable-kvtier", "--kvtier-config-file", str(config), "--page-size", "16",
        "--max-total-tokens", str(args.max_total_tokens), "--admin-api-key", ADMIN],
        pythonpath=[cpu_shims_dir()], cpu_flags=CPU_FLAGS)


Arm = tuple[float, str]  # (verify_fraction, verify_scope)


def _set_arm(server: SGLangServer, arm: Arm) -> None:
    status, answer = request(server.url, {"op": "verify", "fraction": arm[0], "scope": arm[1]},
                             ADMIN)
    if status != 200 or not answer.get("success"):
        raise RuntimeError(f"setting verification to {arm}: {status} {answer}")


def _round(server: SGLangServer, prompts: list[str], clients: int,
           max_new_tokens: int) -> float:
    """One round of `prompts`, `clients` at a time; requests per second."""
    server.flush_cache()
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda text: ask(server, text, max_new_tokens), prompts))
    return len(prompts) / (time.perf_counter() - start)


def _verified(log: str, since: int) -> tuple[int, int, int, float]:
    """(requests verified, chunks verified, mismatched, largest relative error) in `log` from
    offset `since`: one line per verified request."""
    found = VERIFIED.findall(log[since:])
    return (len(found), sum(int(n) for n, _, _ in found), sum(int(m) for _, m, _ in found),
            max((float(e) for _, _, e in found), default=0.0))


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    prompts = documents(args.prompts, facts=args.facts, seed=11)
    arms: list[Arm] = [(args.fractions[0], args.scopes[0])] + [
        (f, scope) for f in args.fractions[1:] for scope in args.scopes]
    rates: dict[Arm, list[float]] = {arm: [] for arm in arms}
    seen = {arm: [0, 0, 0, 0.0] for arm in arms}
    with _server(work, args) as server:
        for text in prompts:  # misses, one at a time: the records are computed alone
            ask(server, text, args.max_new_tokens)
        time.sleep(1.0)  # the last store's log line
        for r in range(args.rounds):
            # each round starts one arm later: no arm always runs first, or after another
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                _set_arm(server, arm)
                mark = len(server.log())
                rates[arm].append(_round(server, prompts * args.repeat, args.clients,
                                         args.max_new_tokens))
                time.sleep(1.0)  # the round's last verifications log after their replies
                *counts, worst = _verified(server.log(), mark)
                for i, count in enumerate(counts):
                    seen[arm][i] += count
                seen[arm][3] = max(seen[arm][3], worst)
    base = statistics.median(rates[arms[0]])
    rows = [{"fraction": f, "scope": scope, "requests_per_s_median": statistics.median(r),
             "requests_per_s_p99": p99(r), "ratio_to_off": statistics.median(r) / base,
             # each round against the baseline's round next to it: the host's drift between
             # rounds (5-10% on a 2-core host) falls out
             "ratio_per_round_median": statistics.median(
                 a / b for a, b in zip(r, rates[arms[0]], strict=True)),
             "rounds": r, "requests_verified": seen[f, scope][0],
             "chunks_verified": seen[f, scope][1],
             "mismatches": seen[f, scope][2], "largest_honest_error": seen[f, scope][3]}
            for (f, scope), r in rates.items()]
    return {"prompts": args.prompts, "repeat": args.repeat, "clients": args.clients,
            "rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
            "baseline": f"verify_fraction {args.fractions[0]}", "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['prompts']} prompts x {result['repeat']} per round x {result['rounds']} "
          f"rounds, {result['clients']} clients, {result['max_new_tokens']} output tokens; ratio "
          f"to {result['baseline']} (medians of rounds)")
    print(f"{'fraction':>9} {'scope':>5} {'req/s med':>10} {'req/s p99':>10} {'ratio':>7} "
          f"{'by round':>8} {'requests':>9} {'chunks':>7} {'mismatch':>9} {'max honest err':>15}")
    for row in result["rows"]:
        print(f"{row['fraction']:>9g} {row['scope']:>5} {row['requests_per_s_median']:>10.2f} "
              f"{row['requests_per_s_p99']:>10.2f} {row['ratio_to_off']:>7.3f} "
              f"{row['ratio_per_round_median']:>8.3f} "
              f"{row['requests_verified']:>9d} {row['chunks_verified']:>7d} "
              f"{row['mismatches']:>9d} "
              f"{row['largest_honest_error']:>15.3g}")


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--repeat wants a whole number >= 1, got {text!r}")
    return int(text)


def _fractions(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v]
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"--fractions wants shares in [0, 1], got {text!r}")
    return values


def _scopes(text: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    if not values or any(v not in VERIFY_SCOPES for v in values):
        raise argparse.ArgumentTypeError(f"--scopes wants some of {', '.join(VERIFY_SCOPES)}, "
                                         f"got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--facts", type=int, default=24, help="lines per document (~16 tokens)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=_at_least_one, default=1,
                        help="times a round sends the prompts")
    parser.add_argument("--fractions", type=_fractions, default=[0.0, 0.01, 1.0],
                        help="verification shares, the first the baseline (default 0,0.01,1)")
    parser.add_argument("--scopes", type=_scopes, default=["full"],
                        help="verify_scope values each share above 0 runs with (default full)")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=3072,
                        help="SGLang's device pool, in tokens (keep it under the prompts')")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--work-dir", type=Path, help="keep configs and logs here")
    args = parser.parse_args()
    with work_dir("verify", args.work_dir) as work:
        result = run(args, work)
    print_table(result)
    write_results("bench_verify", result)


if __name__ == "__main__":
    main()
