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
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["lower_priority", "copy_alone", "copy_threads", "NICE"]

logger = logging.getLogger(__name__)

NICE = 10
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
    _marked.background = True


def copy_threads() -> int:
    """The most threads a copy kernel called on this thread may use: 1 on a background thread
    (see `copy_alone`), else 0 (no limit)."""
    return 1 if getattr(_marked, "background", False) else 0
