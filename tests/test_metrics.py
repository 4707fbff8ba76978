from __future__ import annotations

import logging

import pytest

from kvtier.metrics import Counters, RateLimitedLog


def test_rate_limited_log_counts_what_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("t"), interval=3600)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            log.warning("redis", "tier %s down", "redis")
        log.warning("disk", "disk full")
    assert [r.getMessage() for r in caplog.records] == ["tier redis down", "disk full"]
    log = RateLimitedLog(logging.getLogger("t"), interval=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        log.warning("x", "a")
        log.warning("x", "a")
    assert len(caplog.records) == 2


def test_counters_add_up_across_threads() -> None:
    import threading

    c = Counters()
    threads = [threading.Thread(target=lambda: [c.inc("x") for _ in range(1000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.inc("redis.errors", 2)
    assert c.snapshot() == {"x": 4000, "redis.errors": 2}
