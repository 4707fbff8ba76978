"""Long-document QA with and without kvtier: LMCache's long-doc-QA method, as kvtier's own
code, against real SGLang servers on the project's generated model (CPU is fine).

`--documents` documents of `--document-len` random token ids (half the model's context by
default; no two share a prefix) are each asked `--repeats` short questions
(`--question-len` new tokens each; `--output-len` greedy tokens answer). Per order, with its
own documents and the device cache flushed first: a warm-up round sends every document once
(with a question of its own), then the query round sends the questions in that order:
`tile` (doc0..docN, doc0..docN, ...: the lowest hit rate, since a small device cache has
evicted each document before it comes back), `interleave` (doc0, doc0, ..., doc1, ...: the
highest) or `random` (the tile's requests shuffled). At most `--max-in-flight` requests run
at once (1: one after the other, TTFT without queueing).

Arms (`servers`): `none` (SGLang's device cache only, `--max-total-tokens` sized so one
order's documents are `--pool-ratio` times it), `kvtier-cpu`, `kvtier-cpu-disk-redis`, and
`second-instance`: another server on that Redis runs only the query rounds, so every
document it finds came from Redis (a replay: the CPU + disk + Redis server sent the same
queries before, so it also finds their questions, and the outputs stay comparable).

Then the all-miss run, what kvtier costs when it never hits: `--miss-pairs` pairs of blocks
of `--miss-documents` new documents, each sent once (nothing repeats), one block to the `none`
server and one to the CPU + disk + Redis server (or the CPU one), the `none` block first in
odd pairs and second in even ones (none, kvtier, kvtier, none, none, ...), each pair on fresh
documents, so a steady drift of the host's speed, or a burst of other work on a shared host,
weighs on both sides. The blocks are pooled per arm (the round time is the sum of the blocks').
The `none` server stays up for the whole run (idle while the others serve).

Reported per arm and phase: TTFT mean, median and p99, the round's wall time, hit rate (sum of
`meta_info.cached_tokens` / sum of prompt tokens), and ratios to the `none` arm's same phase;
outputs compared with the `none` arm's request by request. Prints a table, writes
benchmarks/results/bench_longdoc.json (and .png with matplotlib).

    # `make anchors` runs it (~2 min on 2 cores):
    .venv/bin/python -m benchmarks.anchors.bench_longdoc

Needs the SGLang CPU environment (`make sglang-env`) and, for the Redis arms, `redis-server`
on PATH (a throwaway one is started on a free loopback port).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.anchors.cli import add_common, at_least, say
from benchmarks.anchors.client import flush_cache
from benchmarks.anchors.documents import ORDERS, Documents, query_order
from benchmarks.anchors.driver import DriverOptions, DriverRun, Fixed, run_rounds
from benchmarks.anchors.report import (
    Row,
    build_rows,
    check_target,
    format_rows,
    identity_json,
    identity_line,
    options_json,
    plot_rows,
    request_json,
    row_json,
    tiers_line,
)
from benchmarks.anchors.servers import (
    ARMS,
    CPU,
    MODELS,
    NONE,
    REDIS,
    SECOND,
    ServerOptions,
    Servers,
    parse_arms,
    pool_tokens,
    redis_for,
)
from benchmarks.anchors.stats import Identity, Summary, compare_outputs, summarize, summarize_blocks
from benchmarks.common import RESULTS, SGLANG, require, work_dir, write_results
from kvtier.demo.server import SGLangServer

__all__ = ["ORDERS", "Documents", "query_order", "Options", "parse_args", "main"]

MISS_BOUND = 1.03  # the all-miss run: kvtier within 3% of no kvtier, on each of these
MISS_RATIOS: dict[str, Callable[[Row], float]] = {
    "mean_ttft": lambda r: r.mean_ratio, "median_ttft": lambda r: r.median_ratio,
    "round_time": lambda r: r.seconds_ratio}


@dataclass(frozen=True)
class Options:
    """Everything one run takes; see `--help`."""

    docs: Documents = field(default_factory=Documents)
    orders: tuple[str, ...] = ("tile", "interleave")
    max_in_flight: int = 1
    arms: tuple[str, ...] = ARMS
    pool_ratio: float = 3.0
    model: str = "small"
    threads: int = 0
    work_dir: Path | None = None


Phases = dict[str, DriverRun]  # phase label -> its run, in the order run


class Arms:
    """The phases each arm ran (internal to `run_arms`; the tests drive it against a stand-in
    server). Servers are named by URL."""

    def __init__(self, opts: Options):
        self.opts = opts
        self.driver = DriverOptions(output_len=opts.docs.output_len,
                                    max_in_flight=opts.max_in_flight, seed=opts.docs.seed)
        self.phases: dict[str, Phases] = {}
        self.counters: dict[str, dict[str, float]] = {}
        self.writes_landed_s: list[float] = []  # flushes after the kvtier all-miss blocks
        # A server's CPU seconds so far, by URL (None: unknown), and per arm and all-miss
        # block what its server used: on a shared host far steadier than wall time.
        self.cpu: Callable[[str], float | None] = lambda url: None
        self.block_cpu_s: dict[str, dict[str, float]] = {}
        self.landing_cpu_s: list[float] = []  # kvtier's, landing its writes after a block

    def run(self, arm: str, url: str, label: str, prompts: list[list[int]]) -> None:
        say(f"{arm}: {label} ({len(prompts)} requests)")
        self.phases.setdefault(arm, {})[label] = run_rounds(url, Fixed(prompts), self.driver,
                                                            range(1, 2))

    def orders(self, arm: str, url: str, warm: bool = True) -> None:
        """Per order: flush, warm-up round (unless `warm` is False), query round."""
        for order in self.opts.orders:
            if warm:
                flush_cache(url)
                self.run(arm, url, f"{order} warm-up", self.opts.docs.warmup(order))
            self.run(arm, url, f"{order} query", self.opts.docs.queries(order))

    def all_miss(self, base: str, arm: str, kv: str) -> None:
        """`miss_pairs` pairs of blocks, none first in odd pairs and kvtier first in even
        ones (none, kvtier, kvtier, none, ...: a steady drift of the host's speed, and a
        burst of someone else's load, weigh on both sides); pair p's documents go to both
        servers. After each kvtier block its queued writes are landed (a flush) before the
        other server runs; the time that took is kept: kvtier's cost that no TTFT shows."""
        for pair in range(1, self.opts.docs.miss_pairs + 1):
            for name in (NONE, arm) if pair % 2 else (arm, NONE):
                url = base if name == NONE else kv
                flush_cache(url)
                before = self.cpu(url)
                self.run(name, url, f"all-miss {pair}", self.opts.docs.misses(pair))
                served = self.cpu(url)
                if name != NONE:
                    self.writes_landed_s.append(flush_cache(kv))
                    landed = self.cpu(url)
                    if served is not None and landed is not None:
                        self.landing_cpu_s.append(landed - served)
                if before is not None and served is not None:
                    self.block_cpu_s.setdefault(name, {})[f"all-miss {pair}"] = served - before


def _finish(arms: Arms, servers: Servers, arm: str, server: SGLangServer) -> None:
    arms.counters[arm] = servers.counters(arm)
    servers.stop(server)


def run_arms(opts: Options, servers: Servers) -> Arms:
    """Every arm in turn; the `none` server first and up to the end (the all-miss run goes
    back to it). The second instance starts once the CPU + disk + Redis server stopped."""
    arms = Arms(opts)
    arms.cpu = servers.cpu_s
    miss_arm = REDIS if REDIS in opts.arms else CPU if CPU in opts.arms else None
    base = servers.start(NONE)
    arms.orders(NONE, base.url)
    for arm in (CPU, REDIS):
        if arm not in opts.arms:
            continue
        server = servers.start(arm)
        arms.orders(arm, server.url)
        if arm == miss_arm and opts.docs.miss_pairs:
            arms.all_miss(base.url, arm, server.url)
        flush_cache(server.url)  # lands the disk and Redis writes before the next server
        _finish(arms, servers, arm, server)
    if SECOND in opts.arms:
        second = servers.start(SECOND)
        arms.orders(SECOND, second.url, warm=False)
        _finish(arms, servers, SECOND, second)
    _finish(arms, servers, NONE, base)
    return arms


def _parser() -> argparse.ArgumentParser:
    d, p = Documents(), argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    pos = at_least(int, 1)
    p.add_argument("--documents", type=pos, default=d.documents,
                   help="documents per order (each order has its own)")
    p.add_argument("--document-len", type=pos, default=None,
                   help="tokens per document (default: half the model's context)")
    p.add_argument("--question-len", type=pos, default=d.question_len)
    p.add_argument("--output-len", type=pos, default=d.output_len)
    p.add_argument("--repeats", type=pos, default=d.repeats,
                   help="questions per document in the query round")
    p.add_argument("--orders", default="tile,interleave",
                   help=f"comma-separated query orders of {','.join(ORDERS)}")
    p.add_argument("--miss-documents", type=pos, default=d.miss_documents,
                   help="documents per all-miss block")
    p.add_argument("--miss-pairs", type=at_least(int, 0), default=d.miss_pairs,
                   help="pairs of all-miss blocks, none first and kvtier first in turn (an "
                        "even number cancels a steady drift; 0: no all-miss run)")
    p.add_argument("--max-in-flight", type=pos, default=1)
    p.add_argument("--pool-ratio", type=at_least(float, 1.0), default=3.0,
                   help="one order's documents / device pool (sizes --max-total-tokens)")
    add_common(p)
    return p


def parse_args(argv: list[str] | None = None) -> Options:
    """`Options` from the command line; argparse's usage error (exit 2) on a bad value."""
    p = _parser()
    ns = p.parse_args(argv)
    orders = tuple(dict.fromkeys(o.strip() for o in ns.orders.split(",") if o.strip()))
    if not orders or any(o not in ORDERS for o in orders):
        p.error(f"--orders: choose from {','.join(ORDERS)}, got {ns.orders!r}")
    try:
        arms = parse_arms(ns.arms)
    except ValueError as exc:
        p.error(str(exc))
    context = MODELS[ns.model].max_positions
    docs = Documents(ns.documents, ns.document_len or context // 2, ns.question_len,
                     ns.output_len, ns.repeats, ns.miss_documents, ns.miss_pairs, ns.seed)
    if docs.longest() >= context:
        p.error(f"a document with its question and answer is {docs.longest()} tokens, over "
                f"the {ns.model} model's {context}-token context: a shorter --document-len")
    return Options(docs, orders, ns.max_in_flight, arms, ns.pool_ratio, ns.model, ns.threads,
                   ns.work_dir)


COLUMNS = ("arm", "group", "requests", "failed", "mean", "median", "p99", "seconds", "hit",
           "mean_ratio", "median_ratio", "p99_ratio", "seconds_ratio")


def _identities(arms: Arms) -> dict[str, Identity]:
    def outputs(phases: Phases) -> dict[tuple[str, int], list[int]]:
        return {(label, r.client): r.output_ids for label, run in phases.items()
                for r in run.records}

    reference = outputs(arms.phases.get(NONE, {}))
    return {arm: compare_outputs(reference, outputs(phases))
            for arm, phases in arms.phases.items()}


def _summaries(arms: Arms) -> dict[str, dict[str, Summary]]:
    """Per arm and phase; the all-miss blocks pooled into one `all-miss` group."""
    out: dict[str, dict[str, Summary]] = {}
    for arm, phases in arms.phases.items():
        blocks = [run.records for label, run in phases.items() if label.startswith("all-miss")]
        out[arm] = {label: summarize(run.records) for label, run in phases.items()
                    if not label.startswith("all-miss")}
        if blocks:
            out[arm]["all-miss"] = summarize_blocks(blocks)
    return out


def miss_cost(arms: Arms, rows: list[Row]) -> dict[str, Any] | None:
    """kvtier over none in the all-miss run: over every block pooled (mean and median TTFT,
    the blocks' summed wall time), and pair by pair (the spread)."""
    pooled = [r for r in rows if r.arm != NONE and r.group == "all-miss"]
    if not pooled:
        return None
    row = pooled[0]
    out: dict[str, Any] = {"arm": row.arm, "bound": MISS_BOUND}
    for name, get in MISS_RATIOS.items():
        out[f"{name}_ratio"] = get(row)
    out["met"] = all(out[f"{name}_ratio"] <= MISS_BOUND for name in MISS_RATIOS)
    kv, base = arms.phases[row.arm], arms.phases[NONE]
    out["pairs"] = [{"pair": label, **{name: get(r) for name, get in MISS_RATIOS.items()}}
                    for label in kv if label.startswith("all-miss")
                    for r in build_rows({NONE: {label: summarize(base[label].records)},
                                         row.arm: {label: summarize(kv[label].records)}})
                    if r.arm == row.arm]
    kv_cpu, base_cpu = arms.block_cpu_s.get(row.arm, {}), arms.block_cpu_s.get(NONE, {})
    both = [label for label in kv_cpu if label in base_cpu]
    if both and sum(base_cpu[b] for b in both) > 0:
        out["cpu_s"] = {row.arm: sum(kv_cpu[b] for b in both),
                        NONE: sum(base_cpu[b] for b in both)}
        out["cpu_ratio"] = out["cpu_s"][row.arm] / out["cpu_s"][NONE]
        out["landing_cpu_s"] = sum(arms.landing_cpu_s)
    return out


def _miss_line(cost: dict[str, Any] | None, landed: list[float]) -> str:
    if cost is None:
        return "all-miss run: not run"
    pairs = ", ".join(f"{p['mean_ttft']:.2f}" for p in cost["pairs"])
    return (f"all-miss ({cost['arm']} / none, {len(cost['pairs'])} pairs of blocks pooled): "
            f"mean TTFT {cost['mean_ttft_ratio']:.3f}x, median {cost['median_ttft_ratio']:.3f}x,"
            f" round time {cost['round_time_ratio']:.3f}x (bound <= {MISS_BOUND}x on each: "
            f"{'met' if cost['met'] else 'MISSED'}); mean TTFT pair by pair {pairs}; kvtier's "
            f"queued writes landed {max(landed):.2f} s at most after its blocks"
            + _cpu_part(cost))


def _cpu_part(cost: dict[str, Any]) -> str:
    if "cpu_ratio" not in cost:
        return ""
    kv, base = cost["cpu_s"][cost["arm"]], cost["cpu_s"][NONE]
    return (f"; CPU seconds its server used serving the blocks: {kv:.1f} against none's "
            f"{base:.1f}, {cost['cpu_ratio']:.3f}x, and {cost['landing_cpu_s']:.1f} landing "
            f"its writes after them")


def report(opts: Options, arms: Arms,
           servers: dict[str, object]) -> tuple[list[Row], dict[str, Any]]:
    """Print the table and the identity, target and all-miss lines; returns rows and JSON."""
    rows = build_rows(_summaries(arms))
    print(format_rows(rows, COLUMNS, "phase"))
    identities = _identities(arms)
    print("outputs identical to the none arm's, request by request:")
    for arm in arms.phases:
        print(identity_line(arm, identities[arm]))
    print("kvtier (from each server's metrics, warm-up included):")
    for arm, counters in arms.counters.items():
        if arm != NONE:
            print(tiers_line(arm, counters))
    target = check_target(rows, lambda r: r.group.endswith(" query"))
    print(target.line())
    cost = miss_cost(arms, rows)
    print(_miss_line(cost, arms.writes_landed_s))
    data = {
        "method": "long-document QA (LMCache's long_doc_qa method)",
        "options": options_json(opts),
        "servers": servers,
        "rows": [row_json(r) for r in rows],
        "identity": {arm: identity_json(i) for arm, i in identities.items()},
        "kvtier_counters": arms.counters,
        "target": target.json(),
        "all_miss": cost, "all_miss_writes_landed_s": arms.writes_landed_s,
        "query_orders": {o: query_order(o, opts.docs.documents, opts.docs.repeats,
                                        opts.docs.seed) for o in opts.orders},
        "requests": {arm: {label: [request_json(r) for r in run.records]
                           for label, run in phases.items()}
                     for arm, phases in arms.phases.items()},
    }
    return rows, data


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    require("bench_longdoc", SGLANG)
    docs = opts.docs
    pool = pool_tokens(docs.working_set(), docs.longest(), opts.max_in_flight,
                       opts.pool_ratio)
    if docs.working_set() / pool < 2:
        say(f"note: one order's documents are only {docs.working_set() / pool:.1f}x the "
            f"device pool ({pool} tokens); more --documents make it 2-4x")
    stored = (docs.working_set() * len(opts.orders)
              + docs.miss_pairs * docs.miss_documents * docs.longest())
    server_opts = ServerOptions(MODELS[opts.model], pool, docs.working_set(), opts.threads,
                                stored_tokens=stored,
                                warmup_tokens=docs.longest() - docs.output_len)
    with work_dir("longdoc", opts.work_dir) as work, redis_for(opts.arms) as redis_url:
        servers = Servers(server_opts, work, redis_url)
        try:
            arms = run_arms(opts, servers)
        finally:
            servers.stop_all()
        rows, data = report(opts, arms, servers.describe())
    write_results("bench_longdoc", data)
    print(plot_rows(RESULTS / "bench_longdoc.png",
                    f"long-doc QA: {docs.documents} documents x {docs.document_len} tokens, "
                    f"{docs.repeats} questions each; device pool {pool} tokens", rows))


if __name__ == "__main__":
    main()
