"""Multi-turn serving with and without kvtier: SGLang HiCache's multi-turn method, as kvtier's
own code, against real SGLang servers on the project's generated model (CPU is fine).

`--clients` clients each hold a conversation of `--rounds` rounds. Round 1 sends
`--first-input-len` fresh tokens; every later round sends the client's history (everything it
sent before and the answers it got) plus `--turn-input-len` new tokens, and the server answers
`--output-len` tokens (greedy, EOS ignored). No two clients share a prefix. Requests go out one
per Poisson arrival (`--request-rate` per second) with at most `--max-in-flight` at a time;
`--round-barrier` starts round i only when every round i-1 request has answered, and
`--flush-between-rounds` (needs the barrier) then empties the server's device cache
(`POST /flush_cache`), so a later round can only find its history in kvtier's tiers.

Arms (`servers`), each a fresh server: `none` (SGLang's device cache only),
`kvtier-cpu`, `kvtier-cpu-disk-redis`, and `second-instance`, another server on that Redis
which takes over the conversations from round `--second-from` (the CPU + disk + Redis server
serves the rounds before it). The device pool (`--max-total-tokens`) is sized so that the
working set (every conversation's final prompt and answer) is `--pool-ratio` times it. Every
arm sends the same prompts: a conversation's history holds the `none` arm's answers, and each
arm's own answers are compared with them request by request (identical: yes/no).

Reported per arm and round: TTFT mean/median/p90/p99, input and output tokens/s over the
round's span, hit rate (sum of `meta_info.cached_tokens` / sum of prompt tokens), and the
median and p99 TTFT as ratios to the `none` arm's same round. Prints a table, writes
benchmarks/results/bench_multiturn.json (and .png with matplotlib).

    .venv/bin/python -m benchmarks.anchors.bench_multiturn --round-barrier \\
        --flush-between-rounds          # what `make anchors` runs (~2 min on 2 cores)

Needs the SGLang CPU environment (`make sglang-env`) and, for the Redis arms, `redis-server`
on PATH (a throwaway one is started on a free loopback port).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.anchors.cli import add_common, at_least, say
from benchmarks.anchors.client import flush_cache
from benchmarks.anchors.driver import DriverOptions, DriverRun, Record, run_rounds
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
    MODELS,
    NONE,
    REDIS,
    SECOND,
    ServerOptions,
    Servers,
    parse_arms,
    pool_tokens,
    random_ids,
    redis_for,
)
from benchmarks.anchors.stats import Identity, compare_outputs, summarize
from benchmarks.common import RESULTS, SGLANG, require, work_dir, write_results

__all__ = ["Conversations", "History", "Options", "parse_args", "main"]


@dataclass(frozen=True)
class Conversations:
    """The clients' conversations: sizes in tokens; ids are deterministic per seed."""

    clients: int = 6
    rounds: int = 4
    first_input_len: int = 768
    turn_input_len: int = 192
    output_len: int = 16
    seed: int = 0

    def new_input(self, client: int, round_: int) -> list[int]:
        n = self.first_input_len if round_ == 1 else self.turn_input_len
        return random_ids(("multiturn", self.seed, client, round_), n)

    def longest(self) -> int:
        """The last round's prompt plus its answer: what one conversation occupies."""
        return (self.first_input_len + (self.rounds - 1) * self.turn_input_len
                + self.rounds * self.output_len)

    def working_set(self) -> int:
        return self.clients * self.longest()


class History:
    """A `Workload` of `Conversations`: round r's prompt is round r-1's prompt, its answer and
    the new input. The answer is `reference[(client, round)]` when given (so every arm sends
    the same prompts), else what the server answered. One object can serve several
    `run_rounds` calls in turn (the second instance continues the first one's rounds)."""

    def __init__(self, plan: Conversations, reference: dict[tuple[int, int], list[int]] | None):
        self.plan = plan
        self.reference = reference
        self.prompts: dict[tuple[int, int], list[int]] = {}
        self.answers: dict[tuple[int, int], list[int]] = {}

    @property
    def clients(self) -> int:
        return self.plan.clients

    def prompt(self, client: int, round_: int) -> list[int]:
        base: list[int] = []
        if round_ > 1:
            prev = (client, round_ - 1)
            answer = self.reference[prev] if self.reference is not None else self.answers[prev]
            base = self.prompts[prev] + answer
        prompt = base + self.plan.new_input(client, round_)
        self.prompts[(client, round_)] = prompt
        return prompt

    def answered(self, client: int, round_: int, output_ids: list[int]) -> None:
        self.answers[(client, round_)] = output_ids


@dataclass(frozen=True)
class Options:
    """Everything one run takes; see `--help`."""

    plan: Conversations = field(default_factory=Conversations)
    driver: DriverOptions = field(default_factory=lambda: DriverOptions(output_len=16))
    arms: tuple[str, ...] = ARMS
    second_from: int = 3
    pool_ratio: float = 3.0
    model: str = "small"
    threads: int = 0
    work_dir: Path | None = None


@dataclass
class ArmResult:
    """One arm: its rounds' runs (one per server), output identity, kvtier's counters."""

    arm: str
    runs: list[DriverRun] = field(default_factory=list)
    identity: Identity | None = None
    counters: dict[str, dict[str, float]] = field(default_factory=dict)

    def records(self) -> list[Record]:
        return [r for run in self.runs for r in run.records]

    def outputs(self) -> dict[tuple[int, int], list[int]]:
        return {(r.client, r.round): r.output_ids for r in self.records()}


def _rounds(opts: Options, arm: str) -> range:
    """The rounds `arm` serves: the second instance takes over from `second_from`."""
    last = opts.plan.rounds + 1
    if arm == SECOND:
        return range(opts.second_from, last)
    if arm == REDIS and SECOND in opts.arms:
        return range(1, opts.second_from)
    return range(1, last)


def run_arms(opts: Options, servers: Servers) -> dict[str, ArmResult]:
    """Every arm in turn, one server at a time; the `none` arm first (its answers are every
    other arm's history and reference)."""
    results: dict[str, ArmResult] = {}
    reference: dict[tuple[int, int], list[int]] = {}
    history: History | None = None
    for arm in opts.arms:
        if arm != SECOND:  # the second instance continues the previous arm's conversations
            history = History(opts.plan, reference if arm != NONE else None)
        assert history is not None
        res = results[arm] = ArmResult(arm)
        server = servers.start(arm)
        try:
            say(f"{arm}: rounds {_rounds(opts, arm).start}-{_rounds(opts, arm).stop - 1} "
                 f"on {server.url}")
            res.runs.append(run_rounds(server.url, history, opts.driver, _rounds(opts, arm)))
            if arm == REDIS:
                flush_cache(server.url)  # lands its disk and Redis writes before the next arm
            res.counters[arm] = servers.counters(arm)
        finally:
            servers.stop(server)
        if arm == NONE:
            reference.update(res.outputs())
        res.identity = compare_outputs(reference, res.outputs())
    return results


def _parser() -> argparse.ArgumentParser:
    d, p = Conversations(), argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    pos = at_least(int, 1)
    p.add_argument("--clients", type=pos, default=d.clients)
    p.add_argument("--rounds", type=pos, default=d.rounds)
    p.add_argument("--first-input-len", type=pos, default=d.first_input_len,
                   help="tokens of round 1's input")
    p.add_argument("--turn-input-len", type=pos, default=d.turn_input_len,
                   help="new tokens each later round appends")
    p.add_argument("--output-len", type=pos, default=d.output_len)
    p.add_argument("--max-in-flight", type=pos, default=2)
    p.add_argument("--request-rate", type=at_least(float, 1e-6), default=2.0,
                   help="Poisson arrivals per second ('inf': as fast as slots free)")
    p.add_argument("--round-barrier", action="store_true",
                   help="round i starts when every round i-1 request has answered")
    p.add_argument("--flush-between-rounds", action="store_true",
                   help="POST /flush_cache between rounds (needs --round-barrier)")
    p.add_argument("--second-from", type=int, default=None,
                   help="the round the second instance takes over (default: rounds//2 + 1)")
    p.add_argument("--pool-ratio", type=at_least(float, 1.0), default=3.0,
                   help="working set / device pool (sizes --max-total-tokens; default 3)")
    add_common(p)
    return p


def parse_args(argv: list[str] | None = None) -> Options:
    """`Options` from the command line; argparse's usage error (exit 2) on a bad value."""
    p = _parser()
    ns = p.parse_args(argv)
    plan = Conversations(ns.clients, ns.rounds, ns.first_input_len, ns.turn_input_len,
                         ns.output_len, ns.seed)
    if ns.flush_between_rounds and not ns.round_barrier:
        p.error("--flush-between-rounds needs --round-barrier (a flush needs an idle server)")
    try:
        arms = parse_arms(ns.arms)
    except ValueError as exc:
        p.error(str(exc))
    driver = DriverOptions(ns.output_len, ns.max_in_flight, ns.request_rate,
                           ns.round_barrier, ns.flush_between_rounds, ns.seed)
    second = ns.second_from if ns.second_from is not None else ns.rounds // 2 + 1
    if SECOND in arms and not 2 <= second <= ns.rounds:
        p.error(f"--second-from must be in 2..{ns.rounds} (--rounds), got {second}")
    context = MODELS[ns.model].max_positions
    if plan.longest() >= context:
        p.error(f"a conversation grows to {plan.longest()} tokens, over the {ns.model} "
                f"model's {context}-token context: fewer rounds or shorter inputs")
    return Options(plan, driver, arms, second, ns.pool_ratio, ns.model, ns.threads,
                   ns.work_dir)


COLUMNS = ("arm", "group", "requests", "failed", "mean", "median", "p90", "p99", "input",
           "output", "hit", "median_ratio", "p99_ratio")


def _later(row: Row) -> bool:
    return int(row.group.split()[-1]) >= 2


def report(opts: Options, results: dict[str, ArmResult],
           servers: dict[str, object]) -> tuple[list[Row], dict[str, Any]]:
    """Print the table and the identity and target lines; returns the rows and the JSON."""
    groups = {arm: {f"round {r}": summarize([x for x in res.records() if x.round == r])
                    for r in _rounds(opts, arm)} for arm, res in results.items()}
    rows = build_rows(groups)
    print(format_rows(rows, COLUMNS, "round"))
    print("outputs identical to the none arm's, request by request:")
    for arm, res in results.items():
        print(identity_line(arm, res.identity))
    print("kvtier (from each server's metrics, warm-up included):")
    for arm, res in results.items():
        if arm != NONE:
            print(tiers_line(arm, res.counters.get(arm, {})))
    target = check_target(rows, _later)
    print(target.line())
    data = {
        "method": "multi-turn (SGLang HiCache's bench_multiturn method)",
        "options": options_json(opts),
        "servers": servers,
        "rows": [row_json(r) for r in rows],
        "arms": {arm: {"identity": identity_json(res.identity) if res.identity else None,
                       "kvtier_counters": res.counters,
                       "flushes": [dataclasses.asdict(f) for run in res.runs
                                   for f in run.flushes],
                       "requests": [request_json(x) for x in res.records()]}
                 for arm, res in results.items()},
        "target": target.json(),
    }
    return rows, data


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    require("bench_multiturn", SGLANG)
    plan = opts.plan
    pool = pool_tokens(plan.working_set(), plan.longest(), opts.driver.max_in_flight,
                       opts.pool_ratio)
    if plan.working_set() / pool < 2:
        say(f"note: the working set is only {plan.working_set() / pool:.1f}x the device pool "
            f"({pool} tokens: room for {opts.driver.max_in_flight} requests in flight); "
            f"more --clients make it 2-4x, as the method intends")
    server_opts = ServerOptions(MODELS[opts.model], pool, plan.working_set(), opts.threads,
                                warmup_tokens=plan.longest() - plan.output_len)
    with work_dir("multiturn", opts.work_dir) as work, redis_for(opts.arms) as redis_url:
        servers = Servers(server_opts, work, redis_url)
        try:
            results = run_arms(opts, servers)
        finally:
            servers.stop_all()
        rows, data = report(opts, results, servers.describe())
    write_results("bench_multiturn", data)
    print(plot_rows(RESULTS / "bench_multiturn.png",
                    f"multi-turn: {plan.clients} clients x {plan.rounds} rounds, device pool "
                    f"{pool} tokens (working set {plan.working_set() / pool:.1f}x)", rows))


if __name__ == "__main__":
    main()
