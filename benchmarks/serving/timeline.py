"""What each server's threads spent while its client measured, from samples taken every second.

A client's CPU totals (`RunResult.cpu_s`) run from its launch to its exit: they include the
client's own start (it builds its dataset first, ~25 s on a busy core) and, on kvtier's side,
the lower-tier writes that land after the last response. Neither slows the run. The timeline
samples each run's CPU by group (`report.group_cpu`) and, where asked, kvtier's
lower-tier writes, so the report can say what was spent inside the measured window alone: from
the client's end (its result file's mtime, written right after the last response) back by its
`duration`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.serving.report import group_cpu

__all__ = ["Sampler", "GROUPS", "in_window", "forward_totals"]

GROUPS = ("engine", "kvtier", "redis", "other", "writes")
PERIOD_S = 1.0


class Sampler:
    """Samples `[wall time, *GROUPS]` for each run every `period` seconds on its own thread,
    from `start()` to `stop()`. `cpu[i]()` reads run i's CPU by thread name; `writes[i]()`
    (or None) its lower-tier writes so far. A failed read skips that sample."""

    def __init__(self, cpu: Sequence[Callable[[], dict[str, float]]],
                 writes: Sequence[Callable[[], float] | None], period: float = PERIOD_S):
        self._cpu, self._writes, self._period = cpu, writes, period
        self.rows: list[list[list[float]]] = [[] for _ in cpu]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            for i, (cpu, writes) in enumerate(zip(self._cpu, self._writes, strict=True)):
                try:
                    groups = group_cpu(cpu())
                    count = writes() if writes is not None else 0.0
                except OSError:  # the server is going away, or its endpoint is busy
                    continue
                self.rows[i].append([time.time(), *(groups[g] for g in GROUPS[:-1]), count])
            if self._stop.wait(self._period):
                return


def in_window(rows: list[list[float]], start: float, end: float) -> dict[str, float] | None:
    """Each of `GROUPS` between wall times `start` and `end`, interpolated linearly between
    the samples around them; None unless samples cover the window."""
    if len(rows) < 2 or rows[0][0] > start or rows[-1][0] < end:
        return None

    def at(t: float) -> list[float]:
        for before, after in zip(rows, rows[1:]):
            if before[0] <= t <= after[0]:
                w = (t - before[0]) / (after[0] - before[0]) if after[0] > before[0] else 0.0
                return [b + w * (a - b) for b, a in zip(before[1:], after[1:])]
        raise AssertionError("window outside the samples")  # excluded above

    first, last = at(start), at(end)
    return {g: round(b - a, 3) for g, a, b in zip(GROUPS, first, last)}


def forward_totals(path: Path, start: float, end: float) -> dict[str, float] | None:
    """The model forwards that ended inside [`start`, `end`] (wall clock), from the log the
    CPU plugin writes with `KVTIER_BENCH_FORWARD_LOG` (sglang_cpu/kvtier_sglang_cpu.py): per
    kind (extend, decode), how many, their tokens, wall seconds and the scheduler thread's CPU
    seconds. None without a log."""
    if not path.exists():
        return None
    out = {f"{kind}_{what}": 0.0 for kind in ("extend", "decode")
           for what in ("count", "tokens", "wall_s", "cpu_s")}
    for line in path.read_text().splitlines():
        ended, kind, tokens, wall, cpu = line.split()
        if start <= float(ended) <= end:
            out[f"{kind}_count"] += 1
            out[f"{kind}_tokens"] += int(tokens)
            out[f"{kind}_wall_s"] += float(wall)
            out[f"{kind}_cpu_s"] += float(cpu)
    return {k: round(v, 4) for k, v in out.items()}
