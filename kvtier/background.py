"""Background threads yield the CPU to serving.

kvtier's store, writer and prefetch threads do work no request is waiting on, yet on a small
host they compete for the same cores as the serving engine's compute threads (and, through
`torch` and the copy kernel, spawn compute threads of their own). `lower_priority()`, called
first thing on such a thread, raises that thread's nice value, so the OS runs it in the
engine's idle time first. A niced thread still gets the CPU whenever the engine leaves a core
idle (e.g. between forward passes, when it may hold the GIL the scheduler wants), so nothing
starves. Linux sets nice per thread (`setpriority` on a thread id); elsewhere this is a no-op.
`KVTIER_BACKGROUND_NICE` overrides the increment (0 turns this off).

Such a thread's copies also run on that thread alone (`copy_threads()`): a multi-threaded copy
there would start a team of compute threads beside the engine's, and on a host with few cores
the engine's forward pass then waits at its barriers for a core the copy holds. A thread that a
request may wait for (the store thread: the request's slots stay locked until it read them)
keeps its priority and only copies alone (`copy_alone()`).

Priority alone is not enough where the engine computes on the CPU itself: its forward pass
keeps every core busy, so a niced writer still runs on a core the pass wanted (the OS gives it
a slice), and the kernel work of its disk and socket writes is not niced at all. There
`ENGINE` (an `EngineActivity`, told by the SGLang integration when a batch runs) makes the
lower-tier writers yield: while batches run they hold their writes for the engine's quiet
moments, within a bounded wait and backlog (`TierWriter`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["lower_priority", "copy_alone", "name_os_thread", "copy_threads", "NICE",
           "EngineActivity", "ENGINE", "QUIET_S", "STALE_S", "HOLD_S", "HOLD_SHARE",
           "BUSY_SHARE", "URGENT_SHARE", "CpuTime"]

logger = logging.getLogger(__name__)

NICE = 10
# How the lower-tier writers (`TierWriter`) share a CPU engine's cores while batches run: queued
# writes are held this long at most, or until this share of the queue waits (the held chunks
# stay in the CPU tier, which serves them meanwhile) ...
HOLD_S = 30.0
HOLD_SHARE = 0.75
# ... past the hold, a writer spends at most this share of its time writing (the write's wall
# time: its copies, its syscalls, and a local Redis's work on the reply) ...
BUSY_SHARE = 0.02
# ... and none of it once this share of the queue waits (writes would soon be dropped).
URGENT_SHARE = 0.875
_marked = threading.local()  # .background: this thread's copies run on it alone


def lower_priority(nice: int | None = None) -> int | None:
    """Raise the calling thread's nice value by `nice` (default `KVTIER_BACKGROUND_NICE`, else
    `NICE`; capped at 19); returns the new value, or None where threads cannot be prioritized
    one by one or the increment is 0. Either way, the thread's copies use one thread from now
    on (`copy_threads`)."""
    copy_alone()
    if nice is None:
        raw = os.environ.get("KVTIER_BACKGROUND_NICE", "")
        nice = int(raw) if raw.strip().isdigit() else NICE
    if nice <= 0:
        return None
    tid = threading.get_native_id()
    try:
        value = min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except (AttributeError, OSError) as exc:  # not Linux, or a sandbox that forbids it
        logger.debug("kvtier: cannot lower the priority of thread %s: %r",
                     threading.current_thread().name, exc)
        return None
    return value


def copy_alone() -> None:
    """From now on, copy kernels called on this thread use this thread only."""
    name_os_thread()
    _marked.background = True


def name_os_thread() -> None:
    """Show the calling thread's Python name to the OS (`top -H`, `ps -L`, a per-thread
    profile), "kvtier-" shortened to "kv-" to fit Linux's 15 bytes: otherwise every kvtier
    thread shows as the serving process. Linux only; a no-op elsewhere."""
    name = threading.current_thread().name.replace("kvtier-", "kv-", 1)[:15]
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name)
    except OSError:  # not Linux, or /proc is not ours to write
        pass


def copy_threads() -> int:
    """The most threads a copy kernel called on this thread may use: 1 on a background thread
    (see `copy_alone`), else 0 (no limit)."""
    return 1 if getattr(_marked, "background", False) else 0


# The engine counts as busy this long after its last batch: back-to-back batches (decode
# steps, the next request's prefill) leave gaps far shorter than this.
QUIET_S = 0.1
STALE_S = 30.0  # longer than any one forward pass
# How often a waiter checks `go_on` while a batch runs: each wake-up costs the engine a thread
# switch and the GIL, and what it checks (a share of the backlog) moves far slower.
_POLL_S = 0.2


class EngineActivity:
    """Whether the serving engine is computing now, for work that should wait for it.

    The engine calls `enter()` when it launches a batch and `leave()` when it handles that
    batch's result (its forward is over then, wherever it ran), and `idle()` on each turn of
    its loop that ran no batch; the last two say whether requests wait in its queue. A queued
    request is work about to run, not a quiet moment: a turn without a batch while one waits
    (for a store to read its slots, a prefetch, room in the pool) ends in a forward pass soon,
    which a write begun then would slow. Only an `enabled` one is ever `busy()`: the
    integration enables it where the engine computes on the CPU cores kvtier's threads would
    take (on a GPU host a busy engine leaves the CPU to kvtier). Thread-safe.
    """

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._running = 0
        self._entered = -math.inf
        self._left = -math.inf
        self._waiting_at = -math.inf  # when the engine last said requests wait; -inf: none

    def enter(self) -> None:
        with self._lock:
            self._running += 1
            self._entered = time.monotonic()

    def leave(self, waiting: bool = False) -> None:
        """A batch's result is handled; `waiting`: requests wait in the queue."""
        with self._lock:
            self._running = max(0, self._running - 1)
            self._left = time.monotonic()
            self._waiting_at = self._left if waiting else -math.inf

    def idle(self, waiting: bool) -> None:
        """A turn of the engine's loop ran no batch; `waiting`: requests wait in the queue."""
        if waiting or self._waiting_at > -math.inf:  # a lock per turn only when it changes
            with self._lock:
                self._waiting_at = time.monotonic() if waiting else -math.inf

    def ran_since(self, at: float) -> bool:
        """A batch runs now, or one ended after `at` (`time.monotonic()`)."""
        with self._lock:
            return self._running > 0 or self._left > at

    def busy(self, now: float | None = None) -> bool:
        """Enabled, and a batch is running or ended less than `QUIET_S` ago, or requests wait
        to run. A batch whose result never came, or a queue the engine stopped reporting,
        counts for `STALE_S` at most (nothing waits forever on a miscount)."""
        return self.quiet_in(now) > 0

    def quiet_in(self, now: float | None = None) -> float:
        """Seconds until the engine is quiet if no batch starts meanwhile: 0 if it is not
        `busy()`, infinite while a batch runs or requests wait."""
        if not self.enabled:
            return 0.0
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._running > 0 and now - self._entered < STALE_S:
                return math.inf
            if now - self._waiting_at < STALE_S:
                return math.inf
            return max(0.0, self._left + QUIET_S - now)

    def wait_quiet(self, max_s: float, go_on: Callable[[], bool] = lambda: False) -> float:
        """Wait until the engine is not `busy()`, at most `max_s` seconds and no longer once
        `go_on()` is true (polled); returns the seconds waited. Sleeps until the engine could be
        quiet, `_POLL_S` at most: a waiter that woke often would take the GIL from the engine's
        scheduler as often."""
        start = time.monotonic()
        now = start
        while now - start < max_s and not go_on():
            wait = self.quiet_in(now)
            if wait <= 0:
                break
            time.sleep(min(wait, _POLL_S, start + max_s - now))
            now = time.monotonic()
        return now - start


ENGINE = EngineActivity()  # the engine of this process (one serving engine per process)


class CpuTime(NamedTuple):
    """CPU seconds used so far on the cores this process may run on, by everything (`cores`)
    and by this process (`own`), at `wall` (`time.monotonic()`): two of them tell how many of
    those cores other processes kept busy in between (`others_since`)."""

    wall: float
    cores: float
    own: float

    @staticmethod
    def now() -> CpuTime | None:
        """The counts now, from /proc/stat; None where there is none (not Linux)."""
        if not hasattr(os, "sched_getaffinity"):
            return None
        allowed = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        busy = 0
        try:
            with open("/proc/stat") as stat:
                for line in stat:
                    name, *fields = line.split()
                    if name in allowed:  # user nice system idle iowait irq softirq steal
                        ticks = [int(f) for f in fields[:8]]
                        busy += sum(ticks) - ticks[3] - ticks[4]
        except (OSError, ValueError, IndexError):
            return None
        times = os.times()
        return CpuTime(time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), times.user + times.system)

    def others_since(self, before: CpuTime) -> float:
        """How many of the cores other processes kept busy, on average, from `before` to this."""
        wall = self.wall - before.wall
        if wall <= 0:
            return 0.0
        return max(0.0, (self.cores - before.cores) - (self.own - before.own)) / wall
