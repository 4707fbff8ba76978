"""Counters, rate-limited warnings and Prometheus exposition."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping

__all__ = ["Counters", "RateLimitedLog", "prometheus_text"]


class Counters:
    """Thread-safe named counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

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


def prometheus_text(stats: Mapping[str, float], prefix: str = "kvtier") -> str:
    """`stats` in the Prometheus text exposition format; keys `tier.name` become labels."""
    lines = []
    for key in sorted(stats):
        tier, dot, name = key.partition(".")
        if dot:
            lines.append(f'{prefix}_{name}{{tier="{tier}"}} {stats[key]}')
        else:
            lines.append(f"{prefix}_{key} {stats[key]}")
    return "\n".join(lines) + "\n"
