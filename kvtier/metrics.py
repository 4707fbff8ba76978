"""Counters and rate-limited warnings (Prometheus export: `prometheus.py`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

__all__ = ["Counters", "RateLimitedLog"]


class Counters:
    """Thread-safe event counters under declared names: the one counting mechanism of kvtier.

    The storage manager owns one; each tier counts into a `scope` of it (handed over in
    `BackendContext.counters`), so every count has one name, `event` or `tier.event`, in the
    manager's `stats()`, in `kvtier stats` and in Prometheus. Counting an undeclared name
    raises `KeyError`: a misspelled counter fails a test instead of starting a new series.

    Args:
        names: the counters to declare now (`declare` adds more).
    """

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._declared: set[str] = set(names)
        self._counts: Counter[str] = Counter()

    def declare(self, *names: str) -> None:
        with self._lock:
            self._declared.update(names)

    def scope(self, prefix: str, *names: str) -> Counters:
        """A view that counts `name` here as `prefix.name` (declaring `names` so)."""
        scoped = _Scope(self, prefix + ".")
        scoped.declare(*names)
        return scoped

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            if name not in self._declared:
                raise KeyError(f"undeclared counter {name!r}")
            self._counts[name] += n

    def snapshot(self, *, declared: bool = False) -> dict[str, int]:
        """The counts so far; with `declared`, also the declared names still at zero."""
        with self._lock:
            if declared:
                return {name: self._counts[name] for name in sorted(self._declared)}
            return dict(self._counts)


class _Scope(Counters):
    """`Counters.scope`: the parent's counters whose names start with `prefix`."""

    def __init__(self, parent: Counters, prefix: str):
        self._parent = parent
        self._prefix = prefix

    def declare(self, *names: str) -> None:
        self._parent.declare(*(self._prefix + name for name in names))

    def scope(self, prefix: str, *names: str) -> Counters:
        return self._parent.scope(self._prefix + prefix, *names)

    def inc(self, name: str, n: int = 1) -> None:
        self._parent.inc(self._prefix + name, n)

    def snapshot(self, *, declared: bool = False) -> dict[str, int]:
        cut = len(self._prefix)
        return {name[cut:]: n for name, n in self._parent.snapshot(declared=declared).items()
                if name.startswith(self._prefix)}


class RateLimitedLog:
    """Logs a warning per `topic` at most once per `interval` seconds, with the count of the
    occurrences it suppressed, so a dead tier cannot flood the log at 3 a.m."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0):
        self._logger = logger
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def warning(self, topic: str, msg: str, *args: object,
                exc_info: BaseException | bool = False) -> None:
        """Log `msg % args` unless `topic` was logged within the interval; with `exc_info`,
        that exception (or the one being handled) goes along with its traceback."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(topic)
            if last is not None and now - last < self._interval:
                self._suppressed[topic] += 1
                return
            self._last[topic] = now
            suppressed = self._suppressed.pop(topic, 0)
        if suppressed:
            msg += " (%d similar warnings suppressed)"
            args = (*args, suppressed)
        self._logger.warning(msg, *args, exc_info=exc_info)
