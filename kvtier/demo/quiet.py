"""Keeping the demo's measurements quiet, and saying how quiet they were.

The host's load: `HostMeter` reads /proc (Linux; elsewhere it reports what it cannot know as
None) for the cores, the load average and the CPU time used over chosen windows, split into the
demo's own processes (the demo process, its children, its servers' process groups) and every
other process. A TTFT ratio compares two measurements taken one after the other: another
process that takes CPU during one of them and not the other moves the ratio, so the demo says
when others took a notable share (`BUSY_CORES`).

The arms: the kvtier server writes its lower tiers (disk, Redis) in its idle moments, which are
exactly when the baseline server measures. `wait_for_writes` waits until its background writes
are done, from kvtier's own gauge (`kvtier_write_queue{tier}`, on the server's own port).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.demo.server import SGLangServer, metrics_text

__all__ = ["HostMeter", "CpuSample", "Quiesce", "WriteWaits", "wait_for_writes", "write_queue",
           "busy", "load_average", "BUSY_CORES", "WRITE_WAIT_S"]

# Other processes' CPU, in cores, from which the demo says its ratios are noisier: half a core
# is a quarter of the 2-core host the demo's figures come from.
BUSY_CORES = 0.5
WRITE_WAIT_S = 60.0  # the most one wait for the kvtier server's writes may take
_PROC = Path("/proc")
_QUEUE = re.compile(r'^kvtier_write_queue\{[^}]*\}\s+(\S+)$', re.MULTILINE)


class CpuSample(NamedTuple):
    """CPU seconds since boot: the whole host's busy time (steal apart) and the demo's own."""

    at: float  # time.monotonic()
    busy_s: float
    steal_s: float
    own_s: float


def load_average() -> tuple[float, float, float] | None:
    """1, 5 and 15-minute load averages; None where the OS cannot say."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return None
    return round(one, 2), round(five, 2), round(fifteen, 2)


def _host_cpu_s(proc: Path, tick: float) -> tuple[float, float] | None:
    """(busy, steal) seconds from /proc/stat's `cpu` line; busy is user + nice + system + irq
    + softirq (guest time is inside user already), idle and iowait are not."""
    try:
        fields = (proc / "stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _own_cpu_s(proc: Path, tick: float, me: int, groups: Iterable[int]) -> float:
    """CPU seconds (user + system, every thread) of the live processes that are `me`, its
    children, or in one of `groups` (the servers' sessions)."""
    groups = set(groups)
    total = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited since the listing
            continue
        # The command name is in parentheses and may hold spaces: fields start after it.
        fields = stat[stat.rindex(")") + 2:].split()
        pid, ppid, pgid = int(entry.name), int(fields[1]), int(fields[2])
        if pid == me or ppid == me or pgid in groups:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


@dataclass
class HostMeter:
    """CPU time over windows: `open()` starts one, `close()` adds it to the totals.

    `groups` names the process groups that count as the demo's own (asked at every sample:
    servers come and go). `proc` and `clock` are for tests.
    """

    groups: Callable[[], Iterable[int]] = tuple
    proc: Path = _PROC
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self.cores = os.cpu_count() or 1
        self.window_s = self.other_s = self.own_s = self.steal_s = 0.0
        self.known = (self.proc / "stat").is_file()
        self.load_peak: float | None = None  # the highest 1-minute load average at a sample
        self._open: CpuSample | None = None

    def sample(self) -> CpuSample | None:
        if (load := load_average()) is not None:
            self.load_peak = max(self.load_peak or 0.0, load[0])
        host = _host_cpu_s(self.proc, self.tick) if self.known else None
        if host is None:
            return None
        own = _own_cpu_s(self.proc, self.tick, os.getpid(), self.groups())
        return CpuSample(self.clock(), host[0], host[1], own)

    def open(self) -> None:
        self._open = self.sample()

    def close(self) -> None:
        start, self._open = self._open, None
        end = self.sample()
        if start is None or end is None:
            return
        own = max(0.0, end.own_s - start.own_s)
        self.window_s += end.at - start.at
        self.own_s += own
        # Clock ticks round both readings: never below zero, never above the host's busy time.
        self.other_s += max(0.0, end.busy_s - start.busy_s - own)
        self.steal_s += max(0.0, end.steal_s - start.steal_s)

    def cores_used(self) -> dict[str, Any]:
        """The windows so far: their length, and the CPU used in them in cores (CPU seconds per
        second) by other processes, by the demo's own, and taken by the hypervisor (steal);
        None where /proc could not say."""
        if not self.known or self.window_s <= 0:
            return {"window_s": round(self.window_s, 2), "other_cores": None,
                    "own_cores": None, "steal_cores": None}
        per = 1.0 / self.window_s
        return {"window_s": round(self.window_s, 2),
                "other_cores": round(self.other_s * per, 2),
                "own_cores": round(self.own_s * per, 2),
                "steal_cores": round(self.steal_s * per, 2)}


def busy(used: dict[str, Any]) -> bool:
    """Whether other processes (or the hypervisor) took a notable share of the CPU."""
    other = (used.get("other_cores") or 0.0) + (used.get("steal_cores") or 0.0)
    return other >= BUSY_CORES


class Quiesce(NamedTuple):
    """One wait for a kvtier server's background writes."""

    waited_s: float
    left: int | None  # chunks still queued when the wait ended (0: done); None: no gauge


def write_queue(url: str) -> int | None:
    """Chunks waiting for a background write, every tier together, from the metrics of the
    server at `url` (SGLang's `--enable-metrics`); None if it does not answer."""
    text = metrics_text(url)
    if not text:
        return None
    return int(sum(float(v) for v in _QUEUE.findall(text)))


def wait_for_writes(url: str, timeout: float = WRITE_WAIT_S, poll_s: float = 0.1) -> Quiesce:
    """Wait until the kvtier server at `url` has no background write queued or running,
    `timeout` seconds at most. Returns at once (left None) if its metrics do not answer: the
    demo then measures as it did without the wait."""
    start = time.monotonic()
    while True:
        left = write_queue(url)
        waited = time.monotonic() - start
        if not left or waited >= timeout:
            return Quiesce(round(waited, 3), left)
        time.sleep(min(poll_s, max(0.0, timeout - waited)))


@dataclass
class WriteWaits:
    """The waits before the baseline's measurements for one kvtier server's writes, and what
    they found."""

    timeout: float = WRITE_WAIT_S
    waits: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    timed_out: int = 0  # waits that ended with writes still queued
    no_gauge: int = 0  # waits whose metrics endpoint did not answer (the flush alone waited)

    def wait(self, server: SGLangServer) -> None:
        """Quiesce `server`: its `/flush_cache` hands every finished request's store to the
        writers and waits for them (`blocking_timeout_secs`, 10 s by default); the gauge then
        says whether they are done, and is polled until they are (`timeout` in all)."""
        start = time.monotonic()
        server.flush_cache()
        left = wait_for_writes(server.url,
                               max(0.0, self.timeout - (time.monotonic() - start))).left
        waited = time.monotonic() - start
        self.waits += 1
        self.total_s += waited
        self.max_s = max(self.max_s, waited)
        self.timed_out += bool(left)
        self.no_gauge += left is None

    def summary(self) -> dict[str, Any]:
        return {"waits": self.waits, "total_s": round(self.total_s, 2),
                "max_s": round(self.max_s, 2), "timed_out": self.timed_out,
                "no_gauge": self.no_gauge, "timeout_s": self.timeout}
