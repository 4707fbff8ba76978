"""The serving benchmark's view of a server's processes: pinning them to cores, their CPU
seconds per thread (from /proc), and kvtier's side (its Prometheus counters, its config).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from kvtier.demo.server import SGLangServer, metrics_text


def pin_threads(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` onto `cores`."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def server_pids(server: SGLangServer) -> list[int]:
    """The server's process and its descendants (the scheduler, the detokenizer, ...)."""
    assert server.proc is not None
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:  # field 4 of /proc/PID/stat, after the parenthesized command name, is the parent
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:  # it ended meanwhile
            continue
        if stat:
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(
                int(entry))
    pids = [server.proc.pid]
    for pid in pids:
        pids += children.get(pid, [])
    return pids


def pin_tree(server: SGLangServer, core: int) -> None:
    """Every thread of the server's processes onto `core` (threads started later inherit it
    from the thread that starts them)."""
    for pid in server_pids(server):
        try:
            pin_threads(pid, {core})
        except FileNotFoundError:  # it ended meanwhile
            continue


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_cpu(pids: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of every thread of `pids`, summed by thread name; a
    process's main thread is named with a trailing "*" (SGLang's scheduler computes there)."""
    out: dict[str, float] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:  # it ended meanwhile
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")] + ("*" if tid == str(pid) else "")
            fields = stat[stat.rindex(")") + 2:].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) * _TICK_S
    return out


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each thread name spent between two `thread_cpu` readings (threads that ended
    meanwhile are not counted; those that started count from zero)."""
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
    return {name: round(s, 3) for name, s in sorted(spent.items()) if s > 0}


# ---- kvtier's side ----

def scrape_counters(port: int) -> dict[str, float]:
    """kvtier's counters from its Prometheus endpoint, summed over labels (`{}` if none),
    its time on SGLang's scheduler thread per call (`scheduler_seconds.<call>`), and the time
    and count of each piece of serving a request (`hit_seconds.<piece>`, `hit_count.<piece>`:
    "gate" is the wait on a prefetch, the misses' included)."""
    out: dict[str, float] = {}
    for line in metrics_text(port).splitlines():
        m = re.match(r"(kvtier_\w+_total)(?:\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        m = re.match(r'kvtier_(scheduler|hit)_seconds_(sum|count)\{\w+="(\w+)"\}\s+(\S+)$',
                     line)
        if m and not (m.group(1) == "scheduler" and m.group(2) == "count"):
            name = "seconds" if m.group(2) == "sum" else "count"
            out[f"{m.group(1)}_{name}.{m.group(3)}"] = float(m.group(4))
    return out


def kvtier_config(path: Path, disk: Path, redis_url: str, metrics_port: int,
                  disk_gb: float, lower_tiers: tuple[str, ...] = ("disk", "redis"),
                  verify_fraction: float = 0.0) -> Path:
    """CPU + `lower_tiers` (disk and Redis by default), kvtier's defaults otherwise (a disk
    tier needs a size); `verify_fraction` only when not 0."""
    values: dict[str, object] = {"metrics_port": metrics_port}
    if verify_fraction:
        values["verify_fraction"] = verify_fraction
    if "disk" in lower_tiers:
        values.update(local_disk=str(disk), max_local_disk_size=disk_gb)
    if "redis" in lower_tiers:
        values["remote_url"] = redis_url
    path.write_text(yaml.safe_dump(values))
    return path
