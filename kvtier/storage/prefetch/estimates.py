"""Online speed estimates: how fast each tier reads and how fast the engine recomputes.

The adaptive prefetch policy (`kvtier.storage.prefetch.planner`) loads a chunk only when it arrives
sooner than the engine could recompute it, so it needs both speeds as they are now, not as
configured:

- `TierSpeed`: a tier's round-trip latency (from its metadata calls, one round trip each) and
  read bandwidth (bytes over the time of a read, less one round trip), fed by the timings the
  failure guard takes around every tier call anyway.
- `PrefillSpeed`: prefill tokens per second, by prompt length, fed by the serving engine's own
  prefill batches.

Every estimate is the median of the last `WINDOW` samples: one outlier (a GC pause, a
reconnect) moves it not at all, and a tier that changes speed is followed within half a window.
Thread-safe; reading an estimate is O(WINDOW).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from statistics import median

__all__ = ["Samples", "TierSpeed", "PrefillSpeed", "WINDOW", "SHORT_PREFILL_TOKENS"]

WINDOW = 16
# Before a tier's first read: a slow network's rate, for the plan's arithmetic. A request
# waits on that guess only for a load so small that even at this rate its bytes take no
# longer than one measured round trip (`TierSpeed.known_for`): its time is its round trips.
PRIOR_READ_BYTES_PER_S = 10e6
# Before the engine's first measured prefill: a small model on a CPU, or a large one on a GPU.
PRIOR_PREFILL_TOKENS_PER_S = 2000.0
# A tier judged too slow to ask is still asked this often (after its requests went on without
# it), so the estimate sees the tier recover.
PROBE_INTERVAL_S = 2.0
# Prefills shorter than this are mostly fixed cost (scheduling, sampling): not a speed sample.
MIN_PREFILL_SAMPLE_TOKENS = 64
# Samples shorter than this still carry much fixed cost: they bound how long a prefill takes,
# not how fast tokens go, so a longer prompt is not costed per token from them (see
# `PrefillSpeed.tokens_per_s`).
SHORT_PREFILL_TOKENS = 512


class Samples:
    """The last `window` values; `median()` is None until the first one."""

    def __init__(self, window: int = WINDOW):
        self._values: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._values.append(value)

    def median(self) -> float | None:
        with self._lock:
            return median(self._values) if self._values else None

    def __len__(self) -> int:
        return len(self._values)


class TierSpeed:
    """A tier's measured read latency and bandwidth, plus the bytes planned on it not yet read
    (so a plan made now queues behind the loads already in flight)."""

    def __init__(self, name: str):
        self.name = name
        self._latency = Samples()
        self._bandwidth = Samples()
        self._lookups: deque[bool] = deque(maxlen=WINDOW)  # whether each lookup found a chunk
        self._lock = threading.Lock()
        self._queued = 0
        self._probed = -math.inf

    def observe_latency(self, seconds: float) -> None:
        """One round trip that moved no data (a `contains` call)."""
        self._latency.add(max(0.0, seconds))

    def probe_due(self, now: float) -> bool:
        """Whether a request that skipped this tier should ask it anyway, off its own path
        (True at most once per `PROBE_INTERVAL_S`)."""
        with self._lock:
            if now - self._probed < PROBE_INTERVAL_S:
                return False
            self._probed = now
            return True

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """A read of `nbytes` that took `seconds`, one round trip included."""
        if nbytes <= 0 or seconds <= 0:
            return
        # What is left after the round trip is transfer time; never less than a tenth of the
        # call, so a latency estimate that ran high cannot make the bandwidth infinite.
        transfer = max(seconds - self.latency_s, seconds / 10)
        self._bandwidth.add(nbytes / transfer)

    def observe_read_bound(self, nbytes: int, seconds: float) -> None:
        """A read of `nbytes` too small to tell transfer from round trip (a small chunk):
        taken as all transfer, a lower bound on the bandwidth, until real reads replace it."""
        if nbytes > 0 and seconds > 0:
            self._bandwidth.add(nbytes / seconds)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """`nbytes` more of a read already under way arrived in `seconds` (no round trip)."""
        if nbytes > 0 and seconds > 0:
            self._bandwidth.add(nbytes / seconds)

    def observe_lookup(self, found: bool) -> None:
        """A request's lookup asked this tier and it held (`found`) or lacked its next chunk."""
        with self._lock:
            self._lookups.append(found)

    @property
    def hit_rate(self) -> float:
        """The share of recent lookups that found a chunk here, with one imagined hit and one
        imagined miss added (0.5 before any lookup): a tier that has not been asked yet is
        worth waiting for as long as a hit would save more than a miss costs."""
        with self._lock:
            return (sum(self._lookups) + 1) / (len(self._lookups) + 2)

    @property
    def latency_s(self) -> float:
        return self._latency.median() or 0.0

    @property
    def read_bytes_per_s(self) -> float:
        return self._bandwidth.median() or PRIOR_READ_BYTES_PER_S

    @property
    def latency_measured(self) -> bool:
        """Whether a round trip was timed yet (else the latency is taken as 0)."""
        return len(self._latency) > 0

    @property
    def measured(self) -> bool:
        """Whether a read was timed yet (else the bandwidth is the prior)."""
        return len(self._bandwidth) > 0

    @property
    def known(self) -> bool:
        """Whether both the round trip and the read bandwidth were timed: until then the
        adaptive policy makes no request wait on this tier."""
        return self.latency_measured and self.measured

    def known_for(self, nbytes: int) -> bool:
        """Whether a load of `nbytes` can be planned on what was measured: `known`, or the
        round trip measured and the bytes so few that even at the prior (a slow network) they
        take no longer than one round trip."""
        return self.known or (self.latency_measured
                              and nbytes <= self.latency_s * PRIOR_READ_BYTES_PER_S)

    def eta_s(self, nbytes: int) -> float:
        """Expected seconds until `nbytes` more, read after what is queued, have arrived."""
        with self._lock:
            queued = self._queued
        return self.latency_s + (queued + nbytes) / self.read_bytes_per_s

    def queue(self, nbytes: int) -> None:
        """Bytes a plan will read from this tier (undo with `unqueue` as they arrive or are
        given up)."""
        with self._lock:
            self._queued += nbytes

    def unqueue(self, nbytes: int) -> None:
        with self._lock:
            self._queued = max(0, self._queued - nbytes)

    def stats(self) -> dict[str, float]:
        # est_measured: 1 when both numbers were measured, 0 while either is still the prior
        # (an operator reading the speeds of a tier that is down must see they are guesses).
        return {"est_latency_seconds": self.latency_s,
                "est_read_bytes_per_second": self.read_bytes_per_s,
                "est_measured": float(self.known)}


class PrefillSpeed:
    """The engine's prefill speed in tokens per second, by prompt length (power-of-two
    buckets: attention makes long prompts slower per token)."""

    def __init__(self, prior_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S):
        self.prior = PRIOR_PREFILL_TOKENS_PER_S
        self.set_prior(prior_tokens_per_s)
        self._buckets: dict[int, Samples] = {}
        self._lock = threading.Lock()

    def set_prior(self, tokens_per_s: float) -> None:
        """The speed to answer with until the first sample (`ValueError` unless > 0)."""
        if not tokens_per_s > 0:
            raise ValueError(f"prior_tokens_per_s must be > 0, got {tokens_per_s}")
        self.prior = float(tokens_per_s)

    def observe(self, tokens: int, seconds: float, prompt_len: int) -> None:
        """A prefill that computed `tokens` new tokens of prompts up to `prompt_len` long in
        `seconds` (a batch counts once, with its longest prompt)."""
        if tokens < MIN_PREFILL_SAMPLE_TOKENS or seconds <= 0:
            return
        bucket = _bucket(max(prompt_len, tokens))
        with self._lock:
            samples = self._buckets.setdefault(bucket, Samples())
        samples.add(tokens / seconds)

    def tokens_per_s(self, prompt_len: int) -> float:
        """The measured speed for prompts of this length (the nearest length measured), or
        the prior before any measurement. When every sample is of prompts under
        `SHORT_PREFILL_TOKENS` and under half this length, a prompt of this length is costed
        as a prefill of the longest sampled length (its time is mostly fixed cost): in
        doubt, recompute looks cheap, and the load must beat that."""
        with self._lock:
            buckets = list(self._buckets.items())
        if not buckets:
            return self.prior
        want = _bucket(prompt_len)
        bucket, samples = min(buckets, key=lambda kv: (abs(kv[0] - want), -kv[0]))
        speed = samples.median() or self.prior
        longest = max(b for b, _ in buckets)
        if longest < want - 1 and (1 << longest) < SHORT_PREFILL_TOKENS:
            return speed * prompt_len / (1 << bucket)
        return speed

    def recompute_s(self, tokens: int, prompt_len: int) -> float:
        """Expected seconds to recompute `tokens` of a `prompt_len`-token prompt."""
        return tokens / self.tokens_per_s(prompt_len)

    def stats(self) -> dict[str, float]:
        with self._lock:
            longest = max(self._buckets, default=None)
        speed = self.prior if longest is None else self.tokens_per_s(1 << longest)
        return {"est_prefill_tokens_per_second": speed,
                "est_prefill_measured": float(longest is not None)}


def _bucket(tokens: int) -> int:
    return max(0, math.ceil(math.log2(max(tokens, 1))))
