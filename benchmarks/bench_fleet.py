"""A fleet sharing one cache: N real SGLang servers behind sglang-router on one Redis Cluster.

What an operator deploys when one machine is not enough: `--servers` (default 3) SGLang servers
on a generated Llama (`make_llama`, CPU flags as in the demo), each with a small device KV pool
(`--max-total-tokens 3000`: SGLang's own prefix cache thrashes), `sglang-router` in front, and
for kvtier a Redis Cluster of 3 masters + 3 replicas (real `redis-server --cluster-enabled` on
loopback ports) shared through `redis-cluster://`. kvtier runs with its CPU tier and the cluster,
defaults otherwise. The load comes from SGLang's own client, `python -m sglang.benchmark.serving
--dataset-name generated-shared-prefix` through the router (the router never retries:
`--disable-retries`, so a server fault shows as a failed request).

Runs, each on fresh servers (and a flushed cluster):
    single        one server, no kvtier, a device pool that holds the whole workload: the
                  cached-token fraction a fleet could hope for
    none/<policy> N servers, no kvtier, router policy round_robin or cache_aware
    kv/<policy>   N servers with kvtier
    failover      kv/round_robin again, on prompts it has already stored: mid-run one Redis
                  master is SIGKILLed; the cluster promotes its replica. Reported: failed
                  requests (client and probes), seconds from the kill to the promotion and
                  from the promotion until hits resume, and how many of the dead master's
                  records the promoted replica lacks (chunks lost).

"Hits resume" is measured with probes: prompts stored (through server 0) before the kill, each
sent once, one after another, to the other servers; the time is when the first of the probes
that are whole hits from then on (>= 80% cached) came back, counted from the promotion.

    make fleet                 # = PYTHONPATH=. .venv/bin/python benchmarks/bench_fleet.py
    PYTHONPATH=. .venv/bin/python benchmarks/bench_fleet.py --servers 2 --num-groups 4

Prints a table, writes benchmarks/results/bench_fleet.json and (with matplotlib) a plot. Needs
`make sglang-env`, `sglang-router` (`pip install -e '.[fleet]'`), `redis-server` and `redis-cli`.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.bench_serving import (
    CLIENT_TIMEOUT_S,
    RunResult,
    client_env,
    parse_result,
)
from benchmarks.bench_serving import Options as ServingOptions
from benchmarks.bench_serving import client_command as serving_command
from benchmarks.common import RESULTS, work_dir, write_results
from kvtier.demo.models import LlamaSpec, make_llama
from kvtier.demo.server import (
    CPU_FLAGS,
    SGLangServer,
    cpu_shims_dir,
    free_port,
    gpu_available,
    metrics_text,
)
from tests.conftest import RedisCluster, RedisProcess, cluster_node_args, create_cluster

POLICIES = ("round_robin", "cache_aware")
FULL_HIT = 0.8  # a probe is a hit when at least this fraction of its prompt was cached
RESUME_STREAK = 3  # hits resume when this many probes in a row are hits
PROBE_DEADLINE_S = 90.0  # a bound on a hang: probes stop here, hit or not
MAIN_RUN = "Starting main benchmark run"  # the client's line after its warm-up
_TIER_COUNTER = re.compile(r'kvtier_(\w+)_total\{tier="(\w+)"\}\s+(\S+)$')
_COUNTER = re.compile(r"kvtier_(\w+)_total\s+(\S+)$")


@dataclass
class Options:
    servers: int = 3
    num_groups: int = 8
    prompts_per_group: int = 4
    system_prompt_len: int = 1024
    question_len: int = 64
    output_len: int = 8
    max_concurrency: int = 4
    max_total_tokens: int = 3000
    single_total_tokens: int = 100_000  # the reference server's pool: the whole workload
    hidden: int = 512
    layers: int = 8
    threads: int = 1  # OMP threads per server (the fleet shares this machine's cores)
    policies: tuple[str, ...] = POLICIES
    failover: bool = True
    probes: int = 40
    probe_len: int = 1024
    kill_after_s: float = 4.0
    node_timeout_ms: int = 2000
    work_dir: Path | None = None


@dataclass
class Failover:
    """What the master failover did (times in seconds from the kill)."""

    victim_port: int = 0
    victim_records: int = 0
    lost_records: int = 0
    promoted_s: float | None = None
    resumed_s: float | None = None  # from the promotion
    probes: list[dict[str, Any]] = field(default_factory=list)
    failed_probes: int = 0


@dataclass
class FleetRun:
    name: str
    policy: str
    servers: int
    kvtier: bool
    client: RunResult
    cached_fraction: float | None = None
    tier_counters: dict[str, float] = field(default_factory=dict)  # "redis.puts": sum over servers
    failover: Failover | None = None


# ---- processes ----

class Router:
    """`python -m sglang_router.launch_router` over `workers`, stopped by its pid."""

    def __init__(self, workers: list[str], policy: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(self.port), "--worker-urls", *workers, "--policy", policy,
               "--disable-retries", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port())]
        self._log = open(log, "ab")
        self._log.write(f"$ {' '.join(cmd)}\n".encode())
        self._log.flush()
        try:
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        except OSError:
            self._log.close()
            raise
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sglang-router did not come up; see {log}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def tier_counters(ports: list[int]) -> dict[str, float]:
    """kvtier's counters, `tier.name` for tier-labelled ones, summed over the servers."""
    out: dict[str, float] = {}
    for port in ports:
        for line in metrics_text(port).splitlines():
            m = _TIER_COUNTER.match(line)
            key, value = (f"{m.group(2)}.{m.group(1)}", m.group(3)) if m else ("", "")
            if not m and (m := _COUNTER.match(line)):
                key, value = m.group(1), m.group(2)
            if key:
                out[key] = out.get(key, 0.0) + float(value)
    return out


# ---- the bench ----

class Fleet:
    def __init__(self, opts: Options, work: Path):
        self.opts = opts
        self.work = work
        context = 2 * (opts.system_prompt_len + opts.question_len) + opts.output_len
        self.context = max(4096, context, opts.probe_len + 64)
        spec = LlamaSpec(hidden=opts.hidden, layers=opts.layers, intermediate=2 * opts.hidden,
                         max_positions=self.context)
        self.model = make_llama(work / "model", spec=spec)
        self.nodes = [RedisProcess(work / f"redis-{i}", args=cluster_node_args(
            opts.node_timeout_ms)) for i in range(6)]
        self.cluster: RedisCluster | None = None
        self.runs: list[FleetRun] = []

    def start_cluster(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        self.cluster = create_cluster(self.nodes, replicas=1)
        return self.cluster

    def stop_cluster(self) -> None:
        for node in self.nodes:
            if node.pid is not None:
                node.stop(signal.SIGKILL)

    def flush_cluster(self) -> None:
        assert self.cluster is not None
        for master in self.cluster.masters().values():
            master.client().flushall()

    def servers(self, name: str, n: int, kvtier: bool, total_tokens: int,
                ) -> tuple[list[SGLangServer], list[int]]:
        """`n` servers started side by side, and their kvtier metrics ports."""
        servers, ports = [], []
        for i in range(n):
            args = ["--max-total-tokens", str(total_tokens), "--context-length",
                    str(self.context)]
            if kvtier:
                assert self.cluster is not None
                ports.append(free_port())
                config = self.work / f"{name}-{i}.yaml"
                config.write_text(yaml.safe_dump({
                    "remote_url": self.cluster.url, "metrics_port": ports[-1]}))
                args += ["--enable-kvtier", "--kvtier-config-file", str(config)]
            shims = [] if gpu_available() else [cpu_shims_dir()]
            servers.append(SGLangServer(
                self.model, self.work / f"{name}-{i}.log", args=args,
                env={"OMP_NUM_THREADS": str(self.opts.threads),
                     "KVTIER_CACHE_DIR": str(self.work / "kernel")},
                pythonpath=shims, cpu_flags=CPU_FLAGS))
        for server in servers:
            server.launch()
        try:
            for server in servers:
                server.wait_ready()
        except BaseException:
            for server in servers:
                server.stop()
            raise
        return servers, ports

    def client(self, name: str, url_port: int) -> tuple[subprocess.Popen[bytes], Path]:
        o = self.opts
        serving = ServingOptions(num_groups=o.num_groups, prompts_per_group=o.prompts_per_group,
                                 question_len=o.question_len, output_len=o.output_len,
                                 max_concurrency=o.max_concurrency)
        out = self.work / f"{name}.jsonl"
        out.unlink(missing_ok=True)
        cmd = serving_command(serving, url_port, self.model, out, o.system_prompt_len, False)
        log = open(self.work / f"{name}.client.log", "ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=client_env(self.work / "client-home"))
        log.close()
        return proc, out

    def finish_client(self, name: str, proc: subprocess.Popen[bytes], out: Path,
                      kvtier: bool) -> RunResult:
        result = RunResult(name, self.opts.system_prompt_len, 1, kvtier,
                           "generated-shared-prefix",
                           requests=self.opts.num_groups * self.opts.prompts_per_group)
        try:
            result.client_rc = proc.wait(CLIENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            result.client_rc = proc.wait()
        if result.client_rc != 0:
            tail = (self.work / f"{name}.client.log").read_text()[-1500:]
            result.errors.append(f"client exited {result.client_rc}: {tail}")
        parse_result(out, result)
        return result

    def run(self, name: str, policy: str, n: int, kvtier: bool, *, failover: bool = False,
            total_tokens: int | None = None) -> FleetRun:
        print(f"{name}: {n} server(s), policy {policy}", flush=True)
        if kvtier:
            self.flush_cluster()
        tag = name.replace("/", "-")  # names files
        servers, ports = self.servers(tag, n, kvtier, total_tokens or self.opts.max_total_tokens)
        router = Router([s.url for s in servers], policy, self.work / f"{tag}.router.log") \
            if policy != "direct" else None
        port = router.port if router is not None else servers[0].port
        try:
            probes: list[list[int]] = []
            kill_after = 0.0
            if failover:  # fill the cache first, so the run below loads what it stored
                probes = self.store_probes(servers[0])
                fill = self.finish_client(f"{tag}-fill", *self.client(f"{tag}-fill", port),
                                          kvtier)
                # Mid-run: the run below hits what the fill stored, so it is the faster one.
                kill_after = min(self.opts.kill_after_s, (fill.duration_s or 0.0) / 4)
            proc, out = self.client(tag, port)
            if failover:  # the client takes seconds to start: count from its first request
                _wait_for_line(self.work / f"{tag}.client.log", MAIN_RUN, proc)
            report = self.fail_over(servers, probes, kill_after) if failover else None
            result = self.finish_client(tag, proc, out, kvtier)
            counters = tier_counters(ports) if kvtier else {}
        finally:
            if router is not None:
                router.stop()
            for server in servers:
                server.stop()
        run = FleetRun(name, policy, n, kvtier, result, tier_counters=counters, failover=report)
        if result.cached_tokens is not None and result.input_tokens:
            run.cached_fraction = result.cached_tokens / result.input_tokens
        self.runs.append(run)
        print(f"  {row(run, None)}", flush=True)
        return run

    # ---- failover ----

    def store_probes(self, server: SGLangServer) -> list[list[int]]:
        rng = random.Random(7)
        probes = [[rng.randrange(4, 430) for _ in range(self.opts.probe_len)]
                  for _ in range(self.opts.probes)]
        for ids in probes:
            server.generate(ids, max_new_tokens=1)
        server.flush_cache()  # hands the stores back; the Redis writes follow
        return probes

    def fail_over(self, servers: list[SGLangServer], probes: list[list[int]],
                  kill_after_s: float) -> Failover:
        assert self.cluster is not None
        cluster = self.cluster
        time.sleep(kill_after_s)
        before = cluster.masters()
        victim = max(before.values(), key=lambda m: int(m.client().dbsize()))
        keys = list(victim.client().scan_iter(count=1000))
        report = Failover(victim.port, len(keys))
        killed = time.monotonic()
        victim.stop(signal.SIGKILL)
        promoted = threading.Event()

        def watch() -> None:
            while time.monotonic() - killed < PROBE_DEADLINE_S:
                now = cluster.masters()
                if len(now) == len(before) and victim.port not in now:
                    report.promoted_s = time.monotonic() - killed
                    promoted.set()
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        self.probe(servers[1:] or servers, probes, killed, report, promoted)
        watcher.join()
        if promoted.is_set():
            fresh = [m for port, m in cluster.masters().items() if port not in before]
            held = sum(int(fresh[0].client().exists(k)) for k in keys) if fresh else 0
            report.lost_records = len(keys) - held
        return report

    def probe(self, servers: list[SGLangServer], probes: list[list[int]], killed: float,
              report: Failover, promoted: threading.Event) -> None:
        streak: list[float] = []
        for i, ids in enumerate(probes):
            if time.monotonic() - killed > PROBE_DEADLINE_S:
                break
            start = time.monotonic() - killed
            try:
                got = servers[i % len(servers)].generate(ids, max_new_tokens=1)
                frac = got["meta_info"]["cached_tokens"] / len(ids)
            except OSError as exc:
                report.failed_probes += 1
                report.probes.append({"start_s": start, "error": repr(exc)[:300]})
                continue
            end = time.monotonic() - killed
            report.probes.append({"start_s": start, "end_s": end, "cached": frac})
            streak = streak + [end] if frac >= FULL_HIT else []
            if promoted.is_set() and len(streak) >= RESUME_STREAK \
                    and report.promoted_s is not None:
                report.resumed_s = max(0.0, streak[0] - report.promoted_s)
                return


def _wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    """Return once `text` appears in `log` (or the process ended, or two minutes passed)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        time.sleep(0.1)


# ---- report ----

def _f(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def row(run: FleetRun, single: float | None) -> str:
    c = run.client
    rel = run.cached_fraction / single if single and run.cached_fraction is not None else None
    t = run.tier_counters
    return (f"| {run.name} | {run.policy} | {run.servers} | {c.failed}/{c.requests} "
            f"| {_f(run.cached_fraction, '.3f')} | {_f(rel, '.2f')} "
            f"| {_f(c.mean_ttft_ms, '.0f')} | {_f(c.median_ttft_ms, '.0f')} "
            f"| {_f(c.request_throughput, '.2f')} "
            f"| {_f(t.get('redis.puts'), '.0f') if run.kvtier else '-'} "
            f"| {_f(t.get('redis.write_present'), '.0f') if run.kvtier else '-'} |")


HEADER = ("| run | policy | servers | failed | cached fraction | vs single | mean TTFT ms "
          "| median TTFT ms | req/s | Redis chunks written | writes skipped (held) |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def report(opts: Options, runs: list[FleetRun]) -> dict[str, Any]:
    single = next((r.cached_fraction for r in runs if r.name == "single"), None)
    print(f"\nFleet benchmark: {opts.servers} servers, sglang-router, Redis Cluster 3+3; "
          f"{opts.num_groups}x{opts.prompts_per_group} prompts, system prompt "
          f"{opts.system_prompt_len}, concurrency {opts.max_concurrency}, "
          f"--max-total-tokens {opts.max_total_tokens}")
    print(HEADER)
    for run in runs:
        print(row(run, single))
    for run in runs:
        f = run.failover
        if f is not None:
            print(f"\nfailover: master :{f.victim_port} SIGKILLed holding {f.victim_records} "
                  f"records; promoted after {_f(f.promoted_s, '.1f')} s; hits resumed "
                  f"{_f(f.resumed_s, '.1f')} s after the promotion; records lost "
                  f"{f.lost_records}; failed requests {run.client.failed} (client) + "
                  f"{f.failed_probes} (probes)")
        for e in run.client.errors:
            print(f"  {run.name}: ERROR {e}")
    return {"options": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(opts).items()},
            "single_cached_fraction": single,
            "runs": [dataclasses.asdict(r) for r in runs]}


def plot(runs: list[FleetRun], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in runs if r.cached_fraction is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r.name for r in shown], [r.cached_fraction for r in shown],
           color=["#888" if not r.kvtier else "#2a7" for r in shown])
    ax.set_ylabel("cached-token fraction")
    ax.set_title("sglang-router fleet on one Redis Cluster")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


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
