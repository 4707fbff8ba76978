"""Up/down state, counters and rate-limited warnings of a remote tier.

A tier that fails at the connection level is marked down: callers then serve misses without
touching the network, while one background thread calls `probe` with exponential backoff (at
most `cap` seconds apart) and marks the tier up as soon as a probe succeeds. Nothing here
raises to callers; `probe` failures are the expected way to learn the server is still gone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis.backoff import ExponentialBackoff

from kvtier.metrics import Counters, RateLimitedLog

__all__ = ["Health"]

logger = logging.getLogger(__name__)

WARN_INTERVAL = 10.0  # seconds between two warnings of one kind; the next one counts the rest


class Health:
    """Thread-safe bookkeeping for one tier named `name` (a redacted URL); events are counted
    in `counters` (which must declare `errors` and `down_events`)."""

    def __init__(self, name: str, probe: Callable[[], None],
                 probe_errors: tuple[type[BaseException], ...], counters: Counters, *,
                 base: float = 0.05, cap: float = 1.0):
        self.name = name
        self._probe_fn = probe
        self._probe_errors = probe_errors
        self._backoff = ExponentialBackoff(cap=cap, base=base)
        self._lock = threading.Lock()
        self._counts = counters
        self._log = RateLimitedLog(logger, WARN_INTERVAL)
        self._prober: threading.Thread | None = None
        self.closed = threading.Event()
        self.down = False

    def count(self, name: str, n: int = 1) -> None:
        self._counts.inc(name, n)

    def counts(self) -> dict[str, int]:
        """Every declared count, zeros included."""
        return self._counts.snapshot(declared=True)

    def warn(self, kind: str, msg: str, *args: object) -> None:
        """Log a warning unless one of this kind was logged in the last WARN_INTERVAL s."""
        self._log.warning(kind, "%s: " + msg, self.name, *args)

    def failed(self, op: str, exc: BaseException) -> None:
        """Record a connection-level failure of `op`: mark the tier down and start probing."""
        with self._lock:
            self._counts.inc("errors")
            if self.closed.is_set():  # calls racing close(): nothing to report or probe
                return
            was_down, self.down = self.down, True
            if not was_down:
                self._counts.inc("down_events")
            if self._prober is None or not self._prober.is_alive():
                self._prober = threading.Thread(target=self._probe_loop, daemon=True,
                                                name="kvtier-probe")
                self._prober.start()
        if not was_down:
            self.warn("down", "%s failed (%s: %.300s); tier down, serving misses until it "
                      "answers", op, type(exc).__name__, exc)

    def _probe_loop(self) -> None:
        attempts = 0
        while not self.closed.wait(self._backoff.compute(attempts)):
            attempts += 1
            try:
                self._probe_fn()
            except self._probe_errors as exc:
                logger.debug("%s: probe %d failed: %s", self.name, attempts, exc)
                continue
            except Exception as exc:  # a dead prober would leave the tier down for good
                self._log.warning("probe-bug", "%s: probe raised %r", self.name, exc)
                continue
            with self._lock:
                self.down = False
                self._prober = None
            logger.info("%s: reachable again after %d probes", self.name, attempts)
            return

    def close(self, timeout: float) -> None:
        """Stop probing (waits up to `timeout` s for a probe in flight); idempotent."""
        self.closed.set()
        with self._lock:
            prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(timeout)
