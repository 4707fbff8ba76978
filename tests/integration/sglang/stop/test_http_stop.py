"""A stop cuts the requests still running with an error its client can read, and aborts them
in the scheduler (so it stores what they prefilled), without a server: a stand-in for SGLang's
tokenizer manager. The real stop: test_sglang_shutdown.py."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvtier.integration.sglang.stop import http_stop


class _Request:
    def __init__(self, rid: str | list[str] | None) -> None:
        self.rid = rid


class _Manager:
    """SGLang's `generate_request` in short: an output per step, until the request ends."""

    def __init__(self, outputs: int | None) -> None:
        self.outputs = outputs  # None: it never ends by itself
        self.aborted: list[str] = []

    async def generate_request(self, obj: _Request, request: Any = None
                               ) -> AsyncIterator[dict[str, int]]:
        obj.rid = obj.rid or "assigned"  # SGLang names the request in its first step
        step = 0
        while self.outputs is None or step < self.outputs:
            await asyncio.sleep(0.01)
            yield {"step": step}
            step += 1

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)


@pytest.fixture
def manager_class(monkeypatch: pytest.MonkeyPatch) -> type[_Manager]:
    class Manager(_Manager):  # patched here only
        pass

    monkeypatch.setattr(http_stop, "_STOP", http_stop._Stop())
    monkeypatch.setattr(http_stop, "CUT_BEFORE_S", 0.0)
    http_stop.cut_requests_at_stop(Manager)
    http_stop.cut_requests_at_stop(Manager)  # idempotent
    return Manager


async def _consume(manager: _Manager, obj: _Request, seen: list[Any]) -> None:
    """What SGLang's stream does: each output, then an error event on a ValueError."""
    try:
        async for out in manager.generate_request(obj):
            seen.append(out)
            await asyncio.sleep(0)  # the response's send
    except ValueError as exc:
        seen.append({"error": str(exc), "code": getattr(exc, "status_code", 400)})


def test_a_stop_ends_running_requests_with_an_error_and_aborts_them(
        manager_class: type[_Manager]) -> None:
    async def run() -> tuple[list[Any], list[Any], _Manager]:
        manager = manager_class(None)
        streams: tuple[list[Any], list[Any]] = ([], [])
        tasks = [asyncio.ensure_future(_consume(manager, _Request(rid), seen))
                 for rid, seen in zip((None, "given"), streams)]
        await asyncio.sleep(0.1)
        http_stop._STOP.begin(signal.SIGINT, grace_s=0.2)  # a signal handler's call
        await asyncio.wait_for(asyncio.gather(*tasks), 5)  # a bound on a hang
        return streams[0], streams[1], manager

    first, second, manager = asyncio.run(run())
    for seen in (first, second):
        assert len(seen) > 2 and all("step" in out for out in seen[:-1])
        assert seen[-1] == {"error": http_stop._STOP.message, "code": 503}
    assert "server stopping (SIGINT)" in http_stop._STOP.message
    assert sorted(manager.aborted) == ["assigned", "given"]
    assert not http_stop._STOP.running


def test_a_request_that_ends_before_the_cut_is_untouched(
        manager_class: type[_Manager]) -> None:
    async def run() -> tuple[list[Any], _Manager]:
        manager = manager_class(3)
        seen: list[Any] = []
        await _consume(manager, _Request("r"), seen)
        http_stop._STOP.begin(signal.SIGTERM, grace_s=0.0)
        await asyncio.sleep(0.05)
        return seen, manager

    seen, manager = asyncio.run(run())
    assert seen == [{"step": 0}, {"step": 1}, {"step": 2}] and manager.aborted == []


def test_a_cancel_that_is_not_the_stop_s_propagates(manager_class: type[_Manager]) -> None:
    async def run() -> None:
        manager = manager_class(None)
        task = asyncio.ensure_future(_consume(manager, _Request("r"), []))
        await asyncio.sleep(0.05)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(run())
