"""The fleet benchmark's runs: the Redis Cluster, N servers behind the gateway (SMG over gRPC
workers, or the legacy sglang-router over HTTP ones), the client, and the master failover with
its probes (`bench_fleet.py` says what each run is).
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import yaml

from benchmarks.fleet.gateway import Gateway, make_grpc_worker, wait_grpc_ready, worker_url
from benchmarks.fleet.report import row
from benchmarks.fleet.shared import Failover, FleetRun, Options
from benchmarks.serving.client import CLIENT_TIMEOUT_S, client_env, parse_result
from benchmarks.serving.client import client_command as serving_command
from benchmarks.serving.shared import Options as ServingOptions
from benchmarks.serving.shared import RunResult
from harness.redis import RedisCluster, RedisProcess, cluster_node_args, create_cluster
from kvtier.demo.models import LlamaSpec, make_llama
from kvtier.demo.server import (
    CPU_FLAGS,
    SGLangServer,
    cpu_shims_dir,
    free_port,
    gpu_available,
    metrics_text,
)

FULL_HIT = 0.8  # a probe is a hit when at least this fraction of its prompt was cached
RESUME_STREAK = 3  # hits resume when this many probes in a row are hits
PROBE_DEADLINE_S = 90.0  # a bound on a hang: probes stop here, hit or not
MAIN_RUN = "Starting main benchmark run"  # the client's line after its warm-up
_TIER_COUNTER = re.compile(r'kvtier_(\w+)_total\{tier="(\w+)"\}\s+(\S+)$')
_COUNTER = re.compile(r"kvtier_(\w+)_total\s+(\S+)$")


# ---- processes ----

class Target(Protocol):
    """Where probes go: a server, or the gateway in front of gRPC workers."""

    def generate(self, input_ids: list[int], max_new_tokens: int = 8) -> dict[str, Any]: ...

    def flush_cache(self) -> None: ...


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

    def servers(self, name: str, n: int, kvtier: bool, total_tokens: int, grpc: bool,
                ) -> tuple[list[SGLangServer], list[int]]:
        """`n` servers started side by side (SMG's gRPC workers with `grpc`), and their kvtier
        metrics ports."""
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
            if grpc:
                make_grpc_worker(servers[-1])
        for server in servers:
            server.launch()
        try:
            for server in servers:
                wait_grpc_ready(server) if grpc else server.wait_ready()
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
        if o.router == "smg":  # SMG routes by the model a request names
            cmd += ["--extra-request-body", json.dumps({"model": str(self.model)})]
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
        grpc = policy != "direct" and self.opts.router == "smg"
        servers, ports = self.servers(tag, n, kvtier, total_tokens or self.opts.max_total_tokens,
                                      grpc)
        try:
            router = Gateway(self.opts.router, [worker_url(s, grpc) for s in servers], policy,
                             self.work / f"{tag}.router.log", model=self.model) \
                if policy != "direct" else None
        except BaseException:
            for server in servers:
                server.stop()
            raise
        port = router.port if router is not None else servers[0].port
        # gRPC workers answer no HTTP: the probes go through the gateway, which picks the server
        first: Target = router if grpc and router is not None else servers[0]
        others: list[Target] = [first] if grpc else list(servers[1:] or servers)
        try:
            probes: list[list[int]] = []
            kill_after = 0.0
            if failover:  # fill the cache first, so the run below loads what it stored
                probes = self.store_probes(first)
                fill = self.finish_client(f"{tag}-fill", *self.client(f"{tag}-fill", port),
                                          kvtier)
                # Mid-run: the run below hits what the fill stored, so it is the faster one.
                kill_after = min(self.opts.kill_after_s, (fill.duration_s or 0.0) / 4)
            proc, out = self.client(tag, port)
            if failover:  # the client takes seconds to start: count from its first request
                _wait_for_line(self.work / f"{tag}.client.log", MAIN_RUN, proc)
            report = self.fail_over(others, probes, kill_after) if failover else None
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

    def store_probes(self, server: Target) -> list[list[int]]:
        rng = random.Random(7)
        probes = [[rng.randrange(4, 430) for _ in range(self.opts.probe_len)]
                  for _ in range(self.opts.probes)]
        for ids in probes:
            server.generate(ids, max_new_tokens=1)
        server.flush_cache()  # hands the stores back; the Redis writes follow
        return probes

    def fail_over(self, targets: list[Target], probes: list[list[int]],
                  kill_after_s: float) -> Failover:
        """Kill the master holding the most records, after `kill_after_s`; probe `targets`."""
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
        self.probe(targets, probes, killed, report, promoted)
        watcher.join()
        if promoted.is_set():
            fresh = [m for port, m in cluster.masters().items() if port not in before]
            held = sum(int(fresh[0].client().exists(k)) for k in keys) if fresh else 0
            report.lost_records = len(keys) - held
        return report

    def probe(self, servers: list[Target], probes: list[list[int]], killed: float,
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
