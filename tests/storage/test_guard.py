"""GuardedTier: a lower tier's failures are counted misses; calls in flight are tracked."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, MemoryObj, lease
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage.guard import GuardedTier
from tests.helpers import SMALL_MHA, make_keys, make_obj


class _Broken(CPUBackend):
    """A real in-memory tier whose every call fails after `fail` is set."""

    name = "broken"
    fail = False
    error: Exception = OSError("disk on fire")

    def _check(self) -> None:
        if self.fail:
            raise self.error

    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        self._check()
        return super().batch_contains(keys)

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        self._check()
        return super().batch_get(keys)

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        self._check()
        return super().batch_put(keys, objs)

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        self._check()
        return super().remove(keys)

    def stats(self) -> dict[str, float]:
        self._check()
        return super().stats()


@pytest.fixture
def alloc() -> MemoryAllocator:
    return MemoryAllocator(1 << 20)


def _guarded(alloc: MemoryAllocator) -> tuple[GuardedTier, _Broken, Counters]:
    inner = _Broken(BackendContext(Config(chunk_size=16), SMALL_MHA, alloc))
    counters = Counters()
    return GuardedTier(inner, counters, RateLimitedLog(logging.getLogger("t"))), inner, counters


def test_failures_are_counted_misses(alloc: MemoryAllocator,
                                     caplog: pytest.LogCaptureFixture) -> None:
    tier, inner, counters = _guarded(alloc)
    keys = make_keys(32)
    objs = [make_obj(alloc, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
    with lease(objs):
        assert tier.batch_put(keys, objs) == 2
    assert tier.batch_contains(keys) == 2
    inner.fail = True
    with caplog.at_level(logging.WARNING):
        assert tier.batch_contains(keys) == 0
        assert tier.batch_get(keys) == []
        assert list(tier.iter_get(keys)) == []
        assert tier.remove(keys) == 0
        assert tier.stats() == {}
    assert counters.snapshot() == {"broken.errors": 5}
    # An outage is one line, no traceback.
    assert "tier broken contains failed: disk on fire (a miss" in caplog.text
    assert "Traceback" not in caplog.text
    tier.close()
    assert alloc.used_bytes == 0, "an object was leaked"


def test_a_bug_in_a_tier_is_logged_with_its_traceback(alloc: MemoryAllocator,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    tier, inner, counters = _guarded(alloc)
    inner.fail, inner.error = True, TypeError("unsupported operand")
    with caplog.at_level(logging.WARNING):
        assert tier.batch_contains(make_keys(32)) == 0
    assert counters.snapshot() == {"broken.errors": 1}
    assert "raised TypeError('unsupported operand')" in caplog.text
    assert "this is a bug" in caplog.text
    assert caplog.records[-1].exc_info is not None  # the traceback goes along
    tier.close()


def test_wait_idle_waits_for_a_call_in_flight(alloc: MemoryAllocator) -> None:
    tier, _, _ = _guarded(alloc)
    keys = make_keys(32)
    objs = [make_obj(alloc, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
    with lease(objs):
        tier.batch_put(keys, objs)
    assert tier.wait_idle(0.0)
    stream = tier.iter_get(keys)
    first = next(stream)  # the read is suspended inside the tier: a call in flight
    assert not tier.wait_idle(0.05)
    stream.close()
    first.release()
    assert tier.wait_idle(0.0)
    tier.close()
    assert alloc.used_bytes == 0
