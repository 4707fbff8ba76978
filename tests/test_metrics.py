from __future__ import annotations

import logging

import pytest

from kvtier.metrics import Counters, RateLimitedLog, prometheus_text


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


def test_counters_and_exposition() -> None:
    c = Counters()
    c.inc("chunks_put", 3)
    c.inc("redis.errors")
    text = prometheus_text(c.snapshot())
    assert "kvtier_chunks_put 3" in text and 'kvtier_errors{tier="redis"} 1' in text
