"""Counters and rate-limited warnings (Prometheus export: `prometheus.py`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

__all__ = ["Counters", "RateLimitedLog"]


class Counters:
    """Thread-safe named counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class RateLimitedLog:
    """Logs a warning per `topic` at most once per `interval` seconds, with the count of the
    occurrences it suppressed, so a dead tier cannot flood the log at 3 a.m."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0):
        self._logger = logger
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def warning(self, topic: str, msg: str, *args: object) -> None:
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
        self._logger.warning(msg, *args)
