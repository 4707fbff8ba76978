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

    c = Counters("x", "redis.errors")
    threads = [threading.Thread(target=lambda: [c.inc("x") for _ in range(1000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.inc("redis.errors", 2)
    assert c.snapshot() == {"x": 4000, "redis.errors": 2}


def test_counters_refuse_undeclared_names_and_scope_by_prefix() -> None:
    c = Counters("chunks_put")
    with pytest.raises(KeyError, match="chunks_putt"):
        c.inc("chunks_putt")
    disk = c.scope("disk", "hits", "misses")
    disk.inc("hits", 3)
    with pytest.raises(KeyError, match="disk.hitz"):
        disk.inc("hitz")
    c.inc("chunks_put")
    assert c.snapshot() == {"disk.hits": 3, "chunks_put": 1}
    assert disk.snapshot() == {"hits": 3}
    assert disk.snapshot(declared=True) == {"hits": 3, "misses": 0}
