"""The anchor benchmarks' arms: real SGLang servers with and without kvtier, on the project's
generated model (`kvtier.demo.models`), started as the demo starts them.

    none                   SGLang alone: its device prefix cache only (the baseline)
    kvtier-cpu             --enable-kvtier, a CPU tier
    kvtier-cpu-disk-redis  --enable-kvtier, CPU + local disk + Redis
    second-instance        another server on the same Redis (CPU + Redis, no disk), so what
                           it finds of another server's work comes from Redis

Every server has the same flags apart from kvtier: the demo's CPU flags, `--max-total-tokens`
sized by the benchmark (its working set 2-4x the device pool), `--sleep-on-idle`, and two
unrelated warm-up requests as long as the benchmark's longest prompt after start-up (one-time
costs of the first long prefills are not anybody's TTFT). kvtier's config is the demo's
(`demo_config`: chunk 256, an arena sized to hold what the run stores, this run's `hash_salt`,
defaults otherwise) plus a `metrics_port`, whose counters (hits per tier, dropped writes) go
into the results.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.anchors.client import flush_cache, generate
from kvtier.demo.local_redis import local_redis, redis_server_binary
from kvtier.demo.models import LlamaSpec, cached_llama
from kvtier.demo.runner import CHUNK_SIZE, FULL_MODEL, SMALL_MODEL, demo_config
from kvtier.demo.server import SGLangServer, cpu_shims_dir, free_port, gpu_available, metrics_text
from kvtier.demo.workload import FIRST_ID

__all__ = ["NONE", "CPU", "REDIS", "SECOND", "ARMS", "MODELS", "VOCAB", "ServerOptions",
           "Servers", "parse_arms", "pool_tokens", "random_ids", "redis_for", "session_cpu_s"]

NONE, CPU, REDIS, SECOND = "none", "kvtier-cpu", "kvtier-cpu-disk-redis", "second-instance"
ARMS = (NONE, CPU, REDIS, SECOND)
MODELS = {"small": SMALL_MODEL, "full": FULL_MODEL}
VOCAB = 400  # prompt ids in [FIRST_ID, VOCAB), as the demo's workload
# Counters, and the time sums of kvtier's histograms (its calls on the scheduler thread, ...).
_COUNTER = re.compile(r"(kvtier_\w+_(?:total|seconds_sum)(?:\{[^}]*\})?)\s+(\S+)$")


def parse_arms(text: str) -> tuple[str, ...]:
    """`--arms`: a comma-separated subset of ARMS, run in ARMS order; `ValueError` says what
    is wrong (the baseline is required: every ratio is to it; the second instance continues
    the CPU + disk + Redis arm)."""
    names = {x.strip() for x in text.split(",") if x.strip()}
    if bad := sorted(names - set(ARMS)):
        raise ValueError(f"unknown arm(s) {bad}; choose from {','.join(ARMS)}")
    if NONE not in names:
        raise ValueError(f"the arms must include {NONE!r}: every ratio is to it")
    if SECOND in names and REDIS not in names:
        raise ValueError(f"{SECOND!r} needs {REDIS!r}: it serves what that server stored")
    return tuple(a for a in ARMS if a in names)


def pool_tokens(working_set: int, longest: int, in_flight: int, ratio: float) -> int:
    """`--max-total-tokens`: `working_set / ratio` (the device pool holds a fraction of what
    the benchmark touches), but never less than `in_flight` of the longest requests plus a
    margin, or SGLang could not run them at all."""
    return max(int(working_set / ratio), in_flight * longest + 64)


def random_ids(tag: object, n: int) -> list[int]:
    """`n` token ids, the same for the same `tag` (any repr-able value)."""
    rng = random.Random(repr(tag))
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


@contextlib.contextmanager
def redis_for(arms: Sequence[str]) -> Iterator[str | None]:
    """A throwaway redis-server on a free loopback port when an arm needs one (stopped by pid
    on exit), else None. `RuntimeError` when `redis-server` is not on PATH."""
    if REDIS not in arms:
        yield None
        return
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError(f"redis-server is not on PATH (`make redis-server`), and arm "
                           f"{REDIS!r} needs it; or leave it out with --arms")
    with local_redis(binary) as url:
        yield url


@dataclass(frozen=True)
class ServerOptions:
    """What every server of one benchmark run shares."""

    model: LlamaSpec
    max_total_tokens: int
    working_set_tokens: int  # what the device pool is sized against
    threads: int = 0  # OMP threads per server; 0: every core
    stored_tokens: int = 0  # what kvtier stores in a run (default: the working set)
    warmup_tokens: int = 512  # the warm-up prompts: the benchmark's longest (first long
    # prefills pay one-time costs: 480 ms against 270 for a 2K prompt on the small model)


class Servers:
    """The servers of one benchmark run, each started warm; `stop_all` stops what is left."""

    def __init__(self, opts: ServerOptions, work: Path, redis_url: str | None):
        self.opts = opts
        self.work = work
        self.redis_url = redis_url
        self.salt = uuid.uuid4().hex[:12]  # an earlier run's chunks in a Redis never hit
        self.model, _ = cached_llama(opts.model)
        self.metrics: dict[str, int] = {}  # server name -> its kvtier metrics port
        self.live: list[SGLangServer] = []

    def arena_gb(self) -> float:
        spec = self.opts.model  # K and V, every layer, in the float32 pool
        per_token = 2 * spec.layers * spec.kv_heads * (spec.hidden // spec.heads) * 4
        # 3x: what a run stores always fits, so a hit's tier is known (no CPU eviction).
        stored = self.opts.stored_tokens or self.opts.working_set_tokens
        return max(0.25, 3 * stored * per_token / 1e9)

    def config(self, arm: str) -> str | None:
        """The kvtier YAML of `arm`, or None for the baseline."""
        if arm == NONE:
            return None
        disk = self.work / "disk" if arm == REDIS else None
        redis = self.redis_url if arm in (REDIS, SECOND) else None
        return demo_config(disk, redis, self.salt, self.arena_gb())

    def start(self, arm: str, name: str | None = None) -> SGLangServer:
        """A ready, warmed-up server for `arm` (log `<work>/<name>.log`)."""
        name = name or arm
        args = ["--max-total-tokens", str(self.opts.max_total_tokens),
                "--context-length", str(self.opts.model.max_positions), "--sleep-on-idle"]
        config = self.config(arm)
        if config is not None:
            port = self.metrics[name] = free_port()
            path = self.work / f"{name}.yaml"
            path.write_text(config + f"metrics_port: {port}\n")
            args += ["--enable-kvtier", "--kvtier-config-file", str(path)]
        threads = self.opts.threads or os.cpu_count() or 1
        server = SGLangServer(self.model, self.work / f"{name}.log", args=args,
                              env={"OMP_NUM_THREADS": str(threads)},
                              pythonpath=[] if gpu_available() else [cpu_shims_dir()])
        self.live.append(server)
        server.start()
        for i in range(2):  # ids no workload prompt shares beyond chance
            flush_cache(server.url)
            generate(server.url, random_ids(("warmup", name, i), self.opts.warmup_tokens), 4)
        flush_cache(server.url)
        return server

    def cpu_s(self, url: str) -> float | None:
        """CPU seconds (user + system) the live server at `url` has used so far, every process
        of it (HTTP front, scheduler, detokenizer) with kvtier's threads; None if unknown."""
        for server in self.live:
            if server.url == url and server.proc is not None:
                return session_cpu_s(server.proc.pid)
        return None

    def counters(self, name: str) -> dict[str, float]:
        """kvtier's non-zero counters and histogram time sums of server `name` (per label
        set), `{}` for a server without kvtier."""
        port = self.metrics.get(name)
        out: dict[str, float] = {}
        for line in metrics_text(port).splitlines() if port else []:
            m = _COUNTER.match(line)
            if m and float(m.group(2)):
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self, server: SGLangServer) -> None:
        server.stop()
        if server in self.live:
            self.live.remove(server)

    def stop_all(self) -> None:
        for server in list(self.live):
            self.stop(server)

    def describe(self) -> dict[str, object]:
        """For the results file."""
        return {"model": self.opts.model.name(), "model_path": str(self.model),
                "max_total_tokens": self.opts.max_total_tokens,
                "working_set_tokens": self.opts.working_set_tokens,
                "working_set_over_pool": round(
                    self.opts.working_set_tokens / self.opts.max_total_tokens, 2),
                "threads": self.opts.threads or os.cpu_count(), "gpu": gpu_available(),
                "chunk_size": CHUNK_SIZE, "kvtier_config": self.config(REDIS) or "",
                "redis": self.redis_url}


def session_cpu_s(sid: int) -> float | None:
    """CPU seconds used by the live processes of session `sid` (a server started in its own
    session: `start_new_session`), from /proc; None where /proc cannot say (not Linux)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total, seen = 0, False
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone since the listing
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) == sid:  # state ppid pgrp session ...
            total += int(fields[11]) + int(fields[12])  # utime stime
            seen = True
    return total / tick if seen else None
