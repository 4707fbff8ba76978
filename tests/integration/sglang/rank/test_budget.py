"""The scheduler-thread budget: a slow call warns that streams waited only when one could have."""

from __future__ import annotations

import logging
import time

import pytest

from kvtier.integration.sglang.rank.budget import SchedulerBudget
from kvtier.metrics import Counters

LOGGER = "kvtier.integration.sglang.rank.budget"


def _slow(budget: SchedulerBudget, name: str, streams_waited: bool | None = None) -> None:
    with budget.timed(name, "req-1") as call:
        if streams_waited is not None:
            call.streams_waited = streams_waited
        time.sleep(budget.warn_s * 2)


def test_a_slow_call_while_requests_run_warns_and_counts(
        caplog: pytest.LogCaptureFixture) -> None:
    counters = Counters()
    budget = SchedulerBudget(counters, warn_s=0.01)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        _slow(budget, "match_prefix")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "every running stream waited" in warnings[0].getMessage()
    assert "match_prefix" in warnings[0].getMessage()
    assert counters.snapshot()["sglang.scheduler_slow_calls"] == 1


def test_a_slow_call_with_no_request_in_flight_is_debug_only(
        caplog: pytest.LogCaptureFixture) -> None:
    # A /flush_cache on an idle server: the reset is slow, but no stream waited on it.
    counters = Counters()
    budget = SchedulerBudget(counters, warn_s=0.01)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        _slow(budget, "reset", streams_waited=False)
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 1 and "reset took" in debug[0] and "no request was in flight" in debug[0]
    assert "stream waited" not in debug[0]
    assert counters.snapshot(declared=True)["sglang.scheduler_slow_calls"] == 0
    assert budget.slowest is not None and budget.slowest.name == "reset"  # still measured
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        _slow(budget, "reset", streams_waited=True)  # a reset while requests hold the tree
    assert any("every running stream waited" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)
