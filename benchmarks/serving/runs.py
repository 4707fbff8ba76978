"""The serving benchmark's runs: a fresh server per run (or two side by side), their
clients, and what each run measured (`bench_serving.py` describes the phases).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.serving.client import CLIENT_TIMEOUT_S, client_command, client_env, parse_result
from benchmarks.serving.procs import (
    cpu_spent,
    kvtier_config,
    pin_threads,
    pin_tree,
    scrape_counters,
    server_pids,
    thread_cpu,
)
from benchmarks.serving.report import row
from benchmarks.serving.shared import (
    KVTIER_PHASES,
    NOREUSE_PHASES,
    PAIRS,
    SECOND_PHASES,
    Options,
    RunResult,
)
from benchmarks.serving.timeline import Sampler, forward_totals, in_window
from harness.redis import RedisProcess
from kvtier.demo.models import LlamaSpec, make_llama
from kvtier.demo.server import CPU_FLAGS, SGLangServer, cpu_shims_dir, free_port, gpu_available

_COMPILED = re.compile(r"kvtier: compiled the C\+\+ copy kernel in ([\d.]+)s")
_LOADED = re.compile(r"kvtier: loaded (\d+) tokens")
_REFUSED = re.compile(r"Input length \(\d+ tokens\) exceeds the maximum allowed length "
                      r"\(\d+ tokens\)")


# ---- servers ----

@dataclass
class Run:
    """One server and what its run measured."""

    name: str
    result: RunResult
    server: SGLangServer
    metrics_port: int
    launched: float = field(default_factory=time.monotonic)

    def ready(self) -> None:
        """Wait for the server; its start time counts from its launch (a pair's second
        server starts while the first is waited for)."""
        self.server.wait_ready()
        self.result.start_s = time.monotonic() - self.launched


# ---- one set of runs ----

class Bench:
    """The model, the Redis server and every run's result, for one invocation."""

    def __init__(self, opts: Options, work: Path):
        self.opts = opts
        self.work = work
        # Text prompts re-tokenize to ~1.5x their nominal length: leave room for 2x.
        context = max(4096, 2 * (max(opts.system_prompt_lens) + opts.question_len)
                      + opts.output_len)
        self.context = context
        self.spec = LlamaSpec(hidden=opts.hidden, layers=opts.layers,
                              intermediate=2 * opts.hidden, max_positions=context)
        self.model = make_llama(work / "model", spec=self.spec)
        self.redis = RedisProcess(work / "redis")
        self.results: list[RunResult] = []

    def server(self, name: str, config: Path | None, kernel_dir: Path,
               threads: int = 0) -> SGLangServer:
        args = ["--max-total-tokens", str(self.opts.max_total_tokens),
                "--context-length", str(self.context)]
        if config is not None:
            args += ["--enable-kvtier", "--kvtier-config-file", str(config)]
        threads = threads or self.opts.threads or os.cpu_count() or 1
        shims = [] if gpu_available() else [cpu_shims_dir()]
        return SGLangServer(self.model, self.work / f"{name}.log", args=args,
                            env={"OMP_NUM_THREADS": str(threads),
                                 "KVTIER_CACHE_DIR": str(kernel_dir),
                                 "KVTIER_BENCH_FORWARD_LOG": str(self.work / f"{name}.forward")},
                            pythonpath=shims, cpu_flags=CPU_FLAGS)

    def launch(self, phase: str, system_len: int, rep: int, kernel_dir: Path,
               disk: Path | None, repeat: int = 1, threads: int = 0) -> Run:
        """A fresh server for one run of `phase`, launched (not yet ready)."""
        kv = phase in KVTIER_PHASES
        name = f"L{system_len}-r{rep}-{phase}" + (f"-{repeat}" if repeat > 1 else "")
        result = RunResult(phase, system_len, rep, kv,
                           "random-ids" if phase in NOREUSE_PHASES else "generated-shared-prefix",
                           repeat, requests=self.opts.num_groups * self.opts.prompts_per_group)
        metrics_port = free_port()
        config = None
        if kv:
            assert disk is not None
            verify = self.opts.verify_fraction if phase == "second-verify" else 0.0
            config = kvtier_config(self.work / f"{name}.yaml", disk, self.redis.url,
                                   metrics_port, self.opts.disk_gb, self.opts.lower_tiers,
                                   verify)
        run = Run(name, result, self.server(name, config, kernel_dir, threads), metrics_port)
        run.server.launch()
        return run

    def run_one(self, phase: str, system_len: int, rep: int, kernel_dir: Path,
                disk: Path | None, repeat: int = 1) -> RunResult:
        run = self.launch(phase, system_len, rep, kernel_dir, disk, repeat)
        try:
            run.ready()
            self.clients([run], system_len)
            self.collect(run)
        finally:
            self.stop([run])
        return self.check(run)

    def run_pair(self, system_len: int, rep: int, kernel_dir: Path, disk: Path,
                 repeat: int = 1, sides: tuple[str, str] = PAIRS["noreuse-pair"]) -> None:
        """`noreuse-pair`: a server without kvtier and one with it, side by side, each pinned
        to a core of its own (one compute thread each), their clients started together: a
        drift of the host weighs on both alike. The cores swap every set and repeat. `sides`:
        the two results' phases (`PAIRS`); only a `KVTIER_PHASES` one runs kvtier."""
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            raise SystemExit("noreuse-pair needs two cores")
        kv_core = cores[(rep + repeat) % 2]
        none_core = cores[(rep + repeat + 1) % 2]
        runs = [self.launch(sides[0], system_len, rep, kernel_dir, None, repeat, threads=1),
                self.launch(sides[1], system_len, rep, kernel_dir, disk, repeat, threads=1)]
        redis_pid = self.redis.pid
        assert redis_pid is not None
        try:
            for run, core in zip(runs, (none_core, kv_core)):
                run.ready()
                pin_tree(run.server, core)
                run.result.core = core
            # Redis works for kvtier alone: on the other core its writes would slow the
            # server without kvtier (a pair then swings with where the OS puts it).
            pin_threads(redis_pid, {kv_core})
            self.clients(runs, system_len, cores=(none_core, kv_core))
            for run in runs:
                self.collect(run)
        finally:
            pin_threads(redis_pid, set(cores))
            self.stop(runs)
        for run in runs:
            self.check(run)

    def clients(self, runs: list[Run], system_len: int,
                cores: tuple[int, ...] | None = None) -> None:
        """One `sglang.benchmark.serving` per run, all started at once (each on `cores[i]`
        if given, so a client's work weighs on its own server); waits for all."""
        procs = []
        for i, run in enumerate(runs):
            out = self.work / f"{run.name}.jsonl"
            cmd = client_command(self.opts, run.server.port, self.model, out, system_len,
                                 run.result.phase in NOREUSE_PHASES)
            pin = (lambda core=cores[i]: os.sched_setaffinity(0, {core})) if cores else None
            with open(self.work / f"{run.name}.client.log", "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              env=client_env(self.work / "client-home"),
                                              preexec_fn=pin))
        before = [self.cpu(run) for run in runs]
        sampler = Sampler([lambda run=run: self.cpu(run) for run in runs],
                          [self.writes(run) for run in runs])
        sampler.start()
        waiting = dict(enumerate(procs))
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while waiting:
            for i, proc in list(waiting.items()):
                rc = proc.poll()
                if rc is None and time.monotonic() < deadline:
                    continue
                if rc is None:
                    proc.kill()
                    proc.wait()
                    rc = -1
                # Read when its client is done: a kvtier server's writers then catch up.
                runs[i].result.cpu_s = cpu_spent(before[i], self.cpu(runs[i]))
                runs[i].result.client_rc = rc
                del waiting[i]
            time.sleep(0.05)
        sampler.stop()
        for run, rows in zip(runs, sampler.rows):
            self.client_result(run, rows)

    def client_result(self, run: Run, timeline: list[list[float]]) -> None:
        """The client's result file, and what the server spent inside its measured window
        (`timeline`, the forward log)."""
        result = run.result
        if result.client_rc != 0:
            tail = (self.work / f"{run.name}.client.log").read_text()[-1500:]
            result.errors.append(f"client exited {result.client_rc}: {tail}")
        out = self.work / f"{run.name}.jsonl"
        parse_result(out, result)
        result.timeline = timeline
        if result.duration_s and out.exists():
            end = out.stat().st_mtime  # written right after the last response
            start = end - result.duration_s
            result.in_run = in_window(timeline, start, end)
            result.forward = forward_totals(self.work / f"{run.name}.forward", start, end)

    def writes(self, run: Run) -> Callable[[], float] | None:
        """With `--timeline`, a kvtier run's lower-tier writes so far (one scrape of its
        metrics endpoint a second: a little work on its side, hence optional)."""
        if not (self.opts.timeline and run.result.kvtier):
            return None
        return lambda: scrape_counters(run.metrics_port).get("kvtier_writes_total", 0.0)

    def cpu(self, run: Run) -> dict[str, float]:
        """`thread_cpu` of the run's server, and of the Redis server for a kvtier run (it
        works for kvtier alone)."""
        pids = server_pids(run.server)
        if run.result.kvtier and self.redis.pid is not None:
            pids.append(self.redis.pid)
        return thread_cpu(pids)

    @staticmethod
    def collect(run: Run) -> None:
        """kvtier's counters, then its queued disk/Redis writes landed for the next run."""
        if not run.result.kvtier:
            return
        run.result.counters = scrape_counters(run.metrics_port)
        try:
            run.server.flush_cache()
        except OSError as exc:  # urllib's HTTPError included
            run.result.errors.append(f"/flush_cache failed: {exc!r}")

    @staticmethod
    def stop(runs: list[Run]) -> None:
        for run in runs:
            run.server.stop()
        # The disk tier does not fsync: without this the kernel writes this run's records
        # back ~30 s later, on the next run's cores.
        os.sync()

    def check(self, run: Run) -> RunResult:
        """The server log's evidence (kernel compile, loads, refused prompts) in the result."""
        result = run.result
        log = run.server.log()
        refused = _REFUSED.findall(log)
        if refused:
            result.errors.append(f"server refused {len(refused)} request(s) (warm-up included): "
                                  f"{refused[0]}")
        if result.kvtier:
            compiled = _COMPILED.findall(log)
            result.kernel_compile_s = float(compiled[0]) if compiled else None
            result.log_loaded_tokens = sum(int(n) for n in _LOADED.findall(log))
            if result.phase in NOREUSE_PHASES and result.log_loaded_tokens:
                result.errors.append(f"the no-reuse prompts shared a prefix: kvtier loaded "
                                     f"{result.log_loaded_tokens} tokens (try another "
                                     f"--noreuse-seed)")
        self.results.append(result)
        print(f"  {row(result)}", flush=True)
        return result

    def run_set(self, system_len: int, rep: int) -> None:
        """The phases in order; `second` and `second-verify` reuse what `first-again` left in
        Redis and on disk."""
        kernel_dir = self.work / f"kernel-L{system_len}-r{rep}"  # empty until a server builds
        kernel_dir.mkdir()
        shared_disk: Path | None = None
        for i, phase in enumerate(self.opts.phases):
            repeat = self.opts.phases[:i + 1].count(phase)
            disk = None
            if phase in KVTIER_PHASES:
                if phase in SECOND_PHASES and shared_disk is not None:
                    disk = shared_disk  # the Redis and the disk of `first-again`
                else:
                    self.redis.client().flushall()
                    disk = self.work / f"disk-L{system_len}-r{rep}-{phase}-{repeat}"
                    disk.mkdir()
                if phase == "first-again":
                    shared_disk = disk
            if phase in PAIRS:
                self.redis.client().flushall()
                disk = self.work / f"disk-L{system_len}-r{rep}-{phase}-{repeat}"
                disk.mkdir()
                self.run_pair(system_len, rep, kernel_dir, disk, repeat, PAIRS[phase])
            else:
                self.run_one(phase, system_len, rep, kernel_dir, disk, repeat)

    def run(self) -> None:
        self.redis.start()
        try:
            for rep in range(1, self.opts.runs + 1):
                for system_len in self.opts.system_prompt_lens:
                    print(f"system prompt {system_len} tokens, run {rep}/{self.opts.runs}",
                          flush=True)
                    self.run_set(system_len, rep)
        finally:
            self.redis.stop()
