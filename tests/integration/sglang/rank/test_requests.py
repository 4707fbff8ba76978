"""What kvtier reads of a request's `custom_params`: its lifecycle hints, and a bad hint costs
the hint (with a warning naming the key), never the request."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvtier.engine.hints import Hints
from kvtier.integration.sglang.rank import requests
from kvtier.integration.sglang.rank.requests import hints_of
from kvtier.metrics import RateLimitedLog


def _req(custom: object) -> SimpleNamespace:
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom))


def test_hints_come_from_custom_params() -> None:
    assert hints_of(_req({"kvtier_retain_s": 30})) == Hints(retain_s=30)
    assert hints_of(_req({"kvtier_ephemeral_from": 512})) == Hints(ephemeral_from=512)
    assert hints_of(_req({"kvtier_retain_s": 2.5, "kvtier_ephemeral_from": 0})) == \
        Hints(2.5, 0)


@pytest.mark.parametrize("custom", [None, {}, {"kvtier_blend": False}, "not a dict"])
def test_no_hints_without_the_keys(custom: object) -> None:
    assert hints_of(_req(custom)) is None
    assert hints_of(SimpleNamespace()) is None


@pytest.mark.parametrize("custom", [{"kvtier_retain_s": "30"}, {"kvtier_retain_s": -1},
                                    {"kvtier_ephemeral_from": 1.5}, {"kvtier_retain_s": 1e9}])
def test_a_bad_hint_is_ignored_with_a_warning_naming_it(
        custom: dict, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # a fresh rate limit: each case's warning is the first
    monkeypatch.setattr(requests, "_warn", RateLimitedLog(logging.getLogger(requests.__name__)))
    with caplog.at_level(logging.WARNING):
        assert hints_of(_req(custom)) is None
    key = next(iter(custom)).removeprefix("kvtier_")
    assert key in caplog.text
