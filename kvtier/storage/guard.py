"""The failure rule, applied once around every tier: a failing call is a counted miss.

A disk that fills up, a Redis that goes away or a bug in a tier must never reach serving. The
storage manager wraps each tier it builds in a `GuardedTier` (`GuardedHotTier` for the CPU
tier): same interface, same types, but every exception becomes the call's miss value, is
counted as `{tier}.errors` and logged at a limited rate. The guard also times each call
(Prometheus), feeds those timings to the tier's speed estimate (`speed`: round trips from
`contains`, bandwidth from reads) and counts the calls in flight, so a detached tier is closed
only after the calls still using it are done. It also remembers recent `contains` answers
(`kvtier.storage.existence`) for the admission path (`recall_contains`), forgetting those its
own writes, removals and missed reads make stale.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Sequence
from contextlib import closing
from types import TracebackType

from kvtier import prometheus
from kvtier.backends.base import HotTier, ProbeSample, StorageBackend
from kvtier.errors import BackendUnavailable
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage.existence import Existence
from kvtier.storage.prefetch.estimates import TierSpeed

__all__ = ["STAGING", "StagingTier", "GuardedTier", "GuardedHotTier", "MIN_SAMPLE_BYTES"]

STAGING = "staging"  # the name of the CPU tier that only stages loads (`local_cpu: false`)
MIN_SAMPLE_BYTES = 256 << 10  # the smallest probe read taken as a bandwidth sample


class GuardedTier(StorageBackend):
    """`inner` behind the failure rule: any exception from a call is that call's miss."""

    def __init__(self, inner: StorageBackend, counters: Counters, warn: RateLimitedLog):
        self.inner = inner
        self.name = inner.name
        self._counters = counters
        counters.declare(f"{self.name}.errors")
        self._warn = warn
        self._active = 0
        self._idle = threading.Condition()
        self.speed = TierSpeed(self.name)
        self.existence = Existence()

    def recall_contains(self, keys: Sequence[ChunkKey]) -> int:
        """`batch_contains`, answered from recent answers where they cover `keys` (no round
        trip); the tier is asked only from the first chunk not remembered. A failed call
        remembers nothing."""
        n, answered = self.existence.leading(keys)
        if answered:
            return n
        rest = keys[n:]
        with _Call(self, "contains") as call:
            got = self.inner.batch_contains(rest)
            self.speed.observe_latency(call.elapsed())
            self.existence.remember(rest, got)
            return n + got
        return n

    def probe(self, nbytes: int) -> list[ProbeSample]:
        """Time the tier with a scratch record of `nbytes` (`StorageBackend.probe`) whatever
        it holds: each sample's round trip and read feed `speed`. Returns the samples ([]:
        the tier could not be probed, or the probe failed)."""
        with _Call(self, "probe", timed=False):
            samples = self.inner.probe(nbytes)
            for sample in samples:
                self.speed.observe_latency(sample.round_trip_s)
                if sample.read_bytes >= MIN_SAMPLE_BYTES:
                    self.speed.observe_read(sample.read_bytes, sample.read_s)
                else:  # mostly the round trip: a bound, not a bandwidth
                    self.speed.observe_read_bound(sample.read_bytes, sample.read_s)
            return samples
        return []

    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        with _Call(self, "contains") as call:
            got = self.inner.batch_contains(keys)
            self.speed.observe_latency(call.elapsed())
            return got
        return 0

    def first_held(self, keys: Sequence[ChunkKey]) -> int:
        with _Call(self, "contains") as call:
            got = self.inner.first_held(keys)
            self.speed.observe_latency(call.elapsed())
            return got
        return -1

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        with _Call(self, "get") as call:
            objs = self.inner.batch_get(keys)
            self.speed.observe_read(sum(o.nbytes for o in objs), call.elapsed())
            if len(objs) < len(keys):
                self.existence.forget(keys[len(objs):])
            return objs
        return []

    def iter_get(self, keys: Sequence[ChunkKey]) -> Generator[MemoryObj, None, None]:
        # Each chunk is a bandwidth sample as it arrives (the first one pays the round trip),
        # so a slow tier shows while its first long read is still running; what the caller
        # does with each object between our yields is not the tier's time.
        first = True
        got = 0
        with _Call(self, "get"), closing(self.inner.iter_get(keys)) as objs:
            start = time.perf_counter()
            for obj in objs:
                took = time.perf_counter() - start
                if first:
                    self.speed.observe_read(obj.nbytes, took)
                else:
                    self.speed.observe_transfer(obj.nbytes, took)
                first = False
                got += 1
                yield obj
                start = time.perf_counter()
        if got < len(keys):
            self.existence.forget(keys[got:])

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        try:
            with _Call(self, "put"):
                return self.inner.batch_put(keys, objs)
            return 0
        finally:  # after the write: an answer taken while it ran may be stale
            self.existence.forget(keys)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        with _Call(self, "touch", timed=False):
            self.inner.touch(keys)

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        try:
            with _Call(self, "remove"):
                return self.inner.remove(keys)
            return 0
        finally:
            self.existence.forget(keys)

    def stats(self) -> dict[str, float]:
        with _Call(self, "stats", timed=False):
            return self.inner.stats()
        return {}

    def close(self) -> None:
        with _Call(self, "close", timed=False):
            self.inner.close()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call runs on this tier; False if `timeout` ran out first."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._active:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
            return True

    def _enter(self) -> None:
        with self._idle:
            self._active += 1

    def _exit(self) -> None:
        with self._idle:
            self._active -= 1
            if not self._active:
                self._idle.notify_all()

    def _failed(self, op: str, exc: BaseException) -> None:
        """Count and log a failed call: an outage (the tier said `BackendUnavailable`, or the
        OS did) in one line; anything else is a bug in a tier, logged with its traceback."""
        self._counters.inc(f"{self.name}.errors")
        if isinstance(exc, (BackendUnavailable, OSError)):
            self._warn.warning(f"{self.name}-{op}", "kvtier: tier %s %s failed: %s (a miss; "
                               "serving goes on)", self.name, op, exc)
        else:
            self._warn.warning(f"{self.name}-{op}-bug", "kvtier: tier %s %s raised %r (a miss; "
                               "serving goes on); this is a bug, please report it", self.name,
                               op, exc, exc_info=exc)


class GuardedHotTier(GuardedTier, HotTier):
    """The hot tier behind the same guard; eviction and pins pass straight through (they
    touch memory only)."""

    def __init__(self, inner: HotTier, counters: Counters, warn: RateLimitedLog):
        super().__init__(inner, counters, warn)
        self._hot = inner

    def pop_lru(self, nbytes: int) -> list[tuple[ChunkKey, MemoryObj]]:
        return self._hot.pop_lru(nbytes)

    def pin(self, keys: Sequence[ChunkKey]) -> int:
        return self._hot.pin(keys)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        self._hot.unpin(keys)

    @property
    def pinned_bytes(self) -> int:
        return self._hot.pinned_bytes


class StagingTier(GuardedHotTier):
    """A CPU tier that only stages loads (`local_cpu: false`): the lower tiers' chunks arrive
    here in the background, as they would in a CPU tier, so no read of a lower tier runs on
    the serving thread; nothing a request stores is kept, and a chunk goes once delivered."""

    keeps_puts = False


class _Call:
    """One call into a guarded tier: counted while it runs, timed, and its failure swallowed,
    so the `with` block falls through to the call's miss value. (`GeneratorExit` and other
    non-`Exception`s pass through.)"""

    __slots__ = ("_tier", "_op", "_timed", "_start")

    def __init__(self, tier: GuardedTier, op: str, *, timed: bool = True):
        self._tier = tier
        self._op = op
        self._timed = timed
        self._start = 0.0

    def __enter__(self) -> _Call:
        self._tier._enter()
        self._start = time.perf_counter()
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._tier._exit()
        if self._timed:
            prometheus.observe(self._tier.name, self._op, time.perf_counter() - self._start)
        if not isinstance(exc, Exception):
            return False
        self._tier._failed(self._op, exc)
        return True
