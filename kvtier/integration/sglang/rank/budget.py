"""A time budget for kvtier's work on SGLang's scheduler thread.

Every kvtier call the scheduler makes is timed into the Prometheus histogram
`kvtier_scheduler_seconds{call}`; a call over `WARN_S` logs one rate-limited warning naming the
call, the request and what the call did, so a stalled stream at 3 a.m. points at its cause. A
call the body marks as run with no request in flight (a `/flush_cache` on an idle server) stalled
nothing: it logs at DEBUG and is not counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvtier import prometheus
from kvtier.metrics import Counters, RateLimitedLog

__all__ = ["SchedulerBudget", "Call", "WARN_S"]

logger = logging.getLogger(__name__)

WARN_S = 0.05


@dataclass
class Call:
    """One timed call; the body may say what it did or waited on (for the warning), and that
    no stream waited on it (`streams_waited = False`: no request was in flight)."""

    name: str
    rid: str | None
    work: str = ""
    seconds: float = 0.0
    streams_waited: bool = True


class SchedulerBudget:
    """Times scheduler-thread calls, counting those over `warn_s` that streams waited on in
    `sglang.scheduler_slow_calls`; `slowest` is the slowest call so far."""

    def __init__(self, counters: Counters, warn_s: float = WARN_S):
        self.warn_s = warn_s
        self._counters = counters
        counters.declare("sglang.scheduler_slow_calls")
        self._warn = RateLimitedLog(logger)
        self.slowest: Call | None = None

    @contextmanager
    def timed(self, name: str, rid: str | None = None) -> Iterator[Call]:
        call = Call(name, rid)
        start = time.perf_counter()
        try:
            yield call
        finally:
            call.seconds = time.perf_counter() - start
            prometheus.observe_scheduler(name, call.seconds)
            if self.slowest is None or call.seconds > self.slowest.seconds:
                self.slowest = call
            if call.seconds > self.warn_s and not call.streams_waited:
                logger.debug("kvtier: %s took %.0f ms on SGLang's scheduler thread (%s); no "
                             "request was in flight", name, call.seconds * 1e3,
                             call.work or "no kvtier work recorded")
            elif call.seconds > self.warn_s:
                self._counters.inc("sglang.scheduler_slow_calls")
                self._warn.warning(f"slow-{name}", "kvtier: %s took %.0f ms on SGLang's "
                                   "scheduler thread (request %s; %s): every running stream "
                                   "waited", name, call.seconds * 1e3, call.rid or "-",
                                   call.work or "no kvtier work recorded")
