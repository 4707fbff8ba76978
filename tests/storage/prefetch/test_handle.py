"""A prefetch's handle on its own: each policy's readiness and deadlines, a drop that runs
exactly once."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kvtier.config import Config
from kvtier.metrics import RateLimitedLog
from kvtier.storage.prefetch import policy as prefetch_policy_module
from kvtier.storage.prefetch.handle import Prefetch
from kvtier.storage.prefetch.policy import prefetch_policy
from tests.helpers import make_keys, run_threads


@pytest.mark.parametrize("policy, ready", [("best_effort", True), ("wait_complete", False),
                                           ("timeout", False), ("adaptive", False)])
def test_ready_follows_the_policy(policy: str, ready: bool) -> None:
    prefetch = Prefetch(make_keys(32), prefetch_policy(policy), budget_s=60.0)
    assert prefetch.ready() is ready
    assert prefetch.ready(now=prefetch.started + 61.0)  # the deadline (wait_complete: ceiling)
    prefetch.finish(2)
    assert prefetch.ready() and prefetch.result() == 2


def test_wait_complete_has_a_ceiling(caplog: pytest.LogCaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A fresh rate limit: another test may have logged the warning this one looks for.
    monkeypatch.setattr(prefetch_policy_module, "_warn",
                        RateLimitedLog(prefetch_policy_module.logger))
    cfg = Config(prefetch_wait_complete_max_ms=30_000.0, prefetch_timeout_base_ms=1.0)
    budget = prefetch_policy("wait_complete").budget_s(cfg.prefetch, 32, recompute_s=1.0)
    prefetch = Prefetch(make_keys(32), prefetch_policy("wait_complete"), budget_s=budget)
    assert not prefetch.ready(now=prefetch.started + 29.0)  # neither timeout nor recompute
    with caplog.at_level("WARNING", logger="kvtier.storage.prefetch.policy"):
        assert prefetch.ready(now=prefetch.started + 30.0)
    assert "prefetch_wait_complete_max_ms" in caplog.text


def test_an_adaptive_deadline_is_set_by_the_plan() -> None:
    prefetch = Prefetch(make_keys(32), prefetch_policy("adaptive"), budget_s=60.0)
    assert not prefetch.ready()
    prefetch.set_deadline(prefetch.started)  # the plan found nothing worth loading
    assert prefetch.ready() and not prefetch.done()


def test_wait_ready_returns_when_the_plan_moves_the_deadline_not_when_the_load_ends() -> None:
    # The plan found nothing worth loading, the load still looks for a tail: the request's
    # first admission check must not wait for that lookup.
    prefetch = Prefetch(make_keys(32), prefetch_policy("adaptive"), budget_s=60.0)
    planner = threading.Timer(0.05, lambda: prefetch.set_deadline(time.monotonic()))
    planner.start()
    try:
        assert prefetch.wait_ready(30.0)  # long before the 30 s bound
        assert not prefetch.done()
        unplanned = Prefetch(make_keys(32), prefetch_policy("adaptive"), budget_s=60.0)
        assert not unplanned.wait_ready(0.01)
        finished = Prefetch(make_keys(32), prefetch_policy("timeout"), budget_s=60.0)
        threading.Timer(0.05, finished.finish, args=(3,)).start()
        assert finished.wait_ready(30.0) and finished.done()
    finally:
        planner.cancel()


def test_bad_policy_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="policy"):
        Prefetch([], prefetch_policy("eventually"))


# -- the drop runs exactly once, whoever asks and whenever the load ends ------------------------


def test_repeated_drops_after_the_load_ended_drop_once() -> None:
    drops: list[Prefetch] = []
    prefetch = Prefetch(make_keys(32), drop=drops.append)
    prefetch.finish(2)
    prefetch.cancel(drop=True)
    prefetch.cancel(drop=True)
    prefetch.cancel()
    prefetch.finish(0)
    assert drops == [prefetch] and prefetch.result() == 2


def test_drop_runs_once_when_cancels_race_the_end_of_the_load() -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: many chances for the race
    try:
        for _ in range(200):
            drops: list[Prefetch] = []
            prefetch = Prefetch([], drop=drops.append)
            _cancels_race_finish(prefetch)
            assert drops == [prefetch]
    finally:
        sys.setswitchinterval(before)


def _cancels_race_finish(prefetch: Prefetch) -> None:
    """Three threads `cancel(drop=True)` while a fourth `finish()`es, released together."""
    barrier = threading.Barrier(4)

    def race(i: int) -> None:
        barrier.wait()
        if i == 0:
            prefetch.finish(1)
        else:
            prefetch.cancel(drop=True)

    run_threads(race, [(i,) for i in range(4)])


def test_a_drop_asked_during_the_load_is_done_when_the_load_is() -> None:
    checked = threading.Event()
    drops: list[Prefetch] = []

    def slow_drop(prefetch: Prefetch) -> None:
        checked.wait(1.0)  # without the fix, result() returns and the test looks meanwhile
        drops.append(prefetch)

    prefetch = Prefetch([], drop=slow_drop)
    prefetch.cancel(drop=True)  # while loading: the worker drops when it stops
    finisher = threading.Thread(target=prefetch.finish, args=(0,))
    finisher.start()
    prefetch.result(timeout=30)
    seen = list(drops)
    checked.set()
    finisher.join(30)
    assert seen == [prefetch]


