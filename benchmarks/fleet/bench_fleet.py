"""A fleet sharing one cache: N real SGLang servers behind SMG on one Redis Cluster.

What an operator deploys when one machine is not enough: `--servers` (default 3) SGLang servers
on a generated Llama (`make_llama`, CPU flags as in the demo), each with a small device KV pool
(`--max-total-tokens 3000`: SGLang's own prefix cache thrashes), SMG (the Shepherd Model
Gateway, `smg launch`) in front, and for kvtier a Redis Cluster of 3 masters + 3 replicas (real
`redis-server --cluster-enabled` on loopback ports) shared through `redis-cluster://`. kvtier
runs with its CPU tier and the cluster, defaults otherwise. Behind SMG the servers are gRPC
workers (`--smg-grpc-mode`) publishing KV events (`--kv-events-config`), kvtier's tier events
included, so SMG's `cache_aware` is its event-driven policy (benchmarks/fleet/gateway.py).
`--router sglang-router` runs the legacy router over HTTP servers instead. The load comes from
SGLang's own client, `python -m sglang.benchmark.serving --dataset-name
generated-shared-prefix` through the gateway (which never retries: `--disable-retries`, so a
server fault shows as a failed request).

Runs, each on fresh servers (and a flushed cluster):
    single        one server, no kvtier, a device pool that holds the whole workload: the
                  cached-token fraction a fleet could hope for
    none/<policy> N servers, no kvtier, gateway policy round_robin or cache_aware
    kv/<policy>   N servers with kvtier
    failover      kv/round_robin again, on prompts it has already stored: mid-run one Redis
                  master is SIGKILLed; the cluster promotes its replica. Reported: failed
                  requests (client and probes), seconds from the kill to the promotion and
                  from the promotion until hits resume, and how many of the dead master's
                  records the promoted replica lacks (chunks lost).

"Hits resume" is measured with probes: prompts stored before the kill, each sent once, one
after another (through SMG, which picks the server; with sglang-router to the servers other
than the one that stored them); the time is when the first of the probes that are whole hits
from then on (>= 80% cached) came back, counted from the promotion.

    make fleet                 # = .venv/bin/python -m benchmarks.fleet.bench_fleet
    .venv/bin/python -m benchmarks.fleet.bench_fleet --servers 2 --num-groups 4
    .venv/bin/python -m benchmarks.fleet.bench_fleet --router sglang-router   # the legacy one

Prints a table, writes benchmarks/results/bench_fleet.json and (with matplotlib) a plot. Needs
`make sglang-env`, the fleet extra (`pip install -e '.[fleet]'`: smg, smg-grpc-servicer,
sglang-router), `redis-server` and `redis-cli`.

The pieces: `shared` (options, what a run measured), `gateway` (SMG or sglang-router as a
process, servers as gRPC workers), `runs` (the cluster, the servers, the runs and the
failover), `report` (the table, the JSON, the plot).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from benchmarks.common import RESULTS, work_dir, write_results
from benchmarks.fleet.gateway import ROUTERS
from benchmarks.fleet.report import plot, report
from benchmarks.fleet.runs import Fleet
from benchmarks.fleet.shared import POLICIES, Options


def parse_args(argv: list[str] | None = None) -> Options:
    d = Options()
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    for f in dataclasses.fields(Options):
        if f.name in ("policies", "failover", "work_dir"):
            continue
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(d, f.name)),
                       default=getattr(d, f.name))
    p.add_argument("--policies", type=lambda v: tuple(x for x in v.split(",") if x),
                   default=d.policies, help=f"comma-separated subset of {','.join(POLICIES)}")
    p.add_argument("--no-failover", dest="failover", action="store_false")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep models, configs and logs here (default: a temp dir, removed)")
    ns = p.parse_args(argv)
    bad = [x for x in ns.policies if x not in POLICIES]
    if bad:
        p.error(f"--policies: unknown {bad}; choose from {POLICIES}")
    if ns.router not in ROUTERS:
        p.error(f"--router: unknown {ns.router!r}; choose from {ROUTERS}")
    return Options(**vars(ns))


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    with work_dir("fleet", opts.work_dir) as work:
        fleet = Fleet(opts, work)
        fleet.start_cluster()
        try:
            fleet.run("single", "direct", 1, False, total_tokens=opts.single_total_tokens)
            for policy in opts.policies:
                fleet.run(f"none/{policy}", policy, opts.servers, False)
                fleet.run(f"kv/{policy}", policy, opts.servers, True)
            if opts.failover:
                fleet.run("failover", "round_robin", opts.servers, True, failover=True)
        finally:
            fleet.stop_cluster()
        out = report(opts, fleet.runs)
    write_results("bench_fleet", out)
    if plot(fleet.runs, RESULTS / "bench_fleet.png"):
        print(f"wrote {RESULTS / 'bench_fleet.png'}")


if __name__ == "__main__":
    main()
