"""Blend or compute: a blend is chosen only when it beats the full prefill of the same tokens.

A blend reads its segments, re-rotates them and recomputes a share of their tokens in kvtier's
own forward; a full prefill runs in the serving engine. Which is faster depends on the host as it
is now: on a quiet 2-core host a blend took 0.29x the full prefill's time, beside one busy
process 1.58x (kvtier's forward loses more to a busy CPU than the engine's does). So each
blend's time is measured (per token it writes, the median of the last `WINDOW`), the engine's
prefill time comes from its own measured speed, and a request blends only while
`blend_s <= max_ratio * prefill_s`.

Before the first blend is measured a request blends (the measurement has to come from
somewhere). While blends lose, one request in `PROBE_AFTER` that would fall back blends anyway
once `PROBE_INTERVAL_S` passed since the last measured blend: the host may have quietened, and
without a fresh measurement the planner would never know. A probe's measurement replaces the
window (what it holds is that old at least), so one probe decides.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from statistics import median
from typing import NamedTuple

__all__ = ["BlendPlanner", "Choice", "WINDOW", "PROBE_AFTER", "PROBE_INTERVAL_S"]

WINDOW = 8  # blends whose per-token time is the estimate
PROBE_AFTER = 8  # fallbacks in a row before one blend re-measures ...
PROBE_INTERVAL_S = 30.0  # ... and at least this long after the last measured blend


class Choice(NamedTuple):
    """One request's choice: `blend` or not, why (`unmeasured`, `faster`, `probe`, `slower`),
    and the two estimates it weighed (`blend_s` is None before any blend was measured)."""

    blend: bool
    reason: str
    blend_s: float | None
    prefill_s: float


class BlendPlanner:
    """Thread-safe. `choose` before a blend is promised, `observe` after each blend ran.

    Args:
        max_ratio: blend only when the blend is estimated to take at most this share of the
            full prefill's time (`blend_max_prefill_ratio`).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, max_ratio: float = 1.0, *, window: int = WINDOW,
                 probe_after: int = PROBE_AFTER, probe_interval_s: float = PROBE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not max_ratio > 0 or math.isinf(max_ratio):
            raise ValueError(f"max_ratio: must be a positive number, got {max_ratio}")
        self.max_ratio = max_ratio
        self._per_token: deque[float] = deque(maxlen=window)
        self._probe_after, self._probe_interval_s = probe_after, probe_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._fallbacks = 0  # in a row, since the last blend
        self._measured_at = -math.inf
        self._probing = False  # the next blend measured is a probe's

    def observe(self, tokens: int, seconds: float) -> None:
        """A blend wrote `tokens` tokens in `seconds` (read, re-rotation and compute)."""
        if tokens <= 0 or not seconds >= 0:
            return
        with self._lock:
            if self._probing:
                self._per_token.clear()
                self._probing = False
            self._per_token.append(seconds / tokens)
            self._measured_at = self._clock()

    def estimate_s(self, tokens: int) -> float | None:
        """How long a blend writing `tokens` tokens is expected to take; None before one
        was measured."""
        with self._lock:
            return median(self._per_token) * tokens if self._per_token else None

    def loses(self, tokens: int, prefill_s: float) -> bool:
        """Whether a blend writing `tokens` tokens is, once measured, estimated to lose to a
        full prefill of `prefill_s` (`choose` would compute it, but for a probe). No choice
        is made or counted."""
        blend_s = self.estimate_s(tokens)
        return blend_s is not None and blend_s > self.max_ratio * prefill_s

    def choose(self, tokens: int, prefill_s: float) -> Choice:
        """Whether a blend writing `tokens` tokens should run instead of a full prefill the
        serving engine is expected to take `prefill_s` for."""
        blend_s = self.estimate_s(tokens)
        with self._lock:
            if blend_s is None:
                choice = Choice(True, "unmeasured", None, prefill_s)
            elif blend_s <= self.max_ratio * prefill_s:
                choice = Choice(True, "faster", blend_s, prefill_s)
            elif self._fallbacks + 1 >= self._probe_after \
                    and self._clock() - self._measured_at >= self._probe_interval_s:
                choice = Choice(True, "probe", blend_s, prefill_s)
                self._probing = True
            else:
                choice = Choice(False, "slower", blend_s, prefill_s)
            self._fallbacks = 0 if choice.blend else self._fallbacks + 1
        return choice
