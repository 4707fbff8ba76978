"""Ctrl-C on a real SGLang server with kvtier, while a response streams: the server stops in
seconds (in-flight requests get a bounded grace, then are aborted), kvtier writes what it had
queued for the disk tier and says so in one line, and nothing is treated as a crash. A second
Ctrl-C forces the stop. The signal goes to the server's whole process group, as a terminal's
Ctrl-C does."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from harness.sglang_server import SGLangServer
from kvtier.integration.sglang.stop.shutdown import DRAIN_S, GRACE_S
from tests.integration.sglang.conftest import CHUNK, prompt, write_config

pytestmark = pytest.mark.sglang

PROMPT = 400
# The design bound is GRACE_S + DRAIN_S + 1 s, plus SGLang's own teardown; the test allows
# twice the grace and drain, so a busy host cannot make it flaky (4-6 s measured on 2 cores).
STOP_BOUND_S = 2 * (GRACE_S + DRAIN_S) + 1


STREAMED = prompt(99, PROMPT)  # the prompt of the response the stop cuts


def _stream_until_cut(server: SGLangServer, started: threading.Event,
                      events: list[str]) -> None:
    """Stream a long answer to `STREAMED`, keeping each `data:` event in `events`, and an
    `OSError` that ended it as `"cut: ..."`."""
    body = json.dumps({"input_ids": STREAMED, "stream": True, "sampling_params": {
        "max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}}).encode()
    req = urllib.request.Request(f"{server.url}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: "):
                    events.append(line[6:].decode().strip())
                started.set()
    except OSError as exc:
        events.append(f"cut: {exc!r}")  # the connection closed without an end
    started.set()


def _server(tiny_llama: Path, tmp_path: Path, *more: str, log: str = "server.log",
            policy: str = "adaptive", spawned: bool = False) -> SGLangServer:
    # Forked children, as every test server's (the test plugin gives a forked child what a
    # spawned one does as it loads kvtier: the first Ctrl-C is left to the launcher), but for
    # the first test's: `spawned` children are SGLang's own, what users run.
    config = write_config(tmp_path / f"{log}.yaml", local_disk=str(tmp_path / "disk"),
                          max_local_disk_size=0.5, prefetch_policy=policy)
    server = SGLangServer(tiny_llama, tmp_path / log, args=[
        "--enable-kvtier", "--kvtier-config-file", str(config), *more],
        fork_children=not spawned)
    return server.start()


def _interrupt_while_streaming(server: SGLangServer, times: int,
                               events: list[str] | None = None) -> float:
    started = threading.Event()
    threading.Thread(target=_stream_until_cut, args=(server, started, [] if events is None
                                                     else events), daemon=True).start()
    assert started.wait(60), "the streaming response never started"
    assert server.proc is not None
    sent = time.monotonic()
    for _ in range(times):
        os.killpg(server.proc.pid, signal.SIGINT)
        time.sleep(0.3)
    server.proc.wait(60)
    return time.monotonic() - sent


DRAINED = re.compile(r"kvtier: stopping: (\d+) queued writes drained in [\d.]+ s, (\d+) dropped")


def _ctrl_c_after(tiny_llama: Path, tmp_path: Path, prompts: int, *more: str,
                  events: list[str] | None = None, spawned: bool = False
                  ) -> tuple[SGLangServer, str, list[tuple[str, str]]]:
    """A server that answered `prompts` prompts (their disk writes queue behind the stream's
    batches), stopped by one Ctrl-C while a response streams (its events in `events`): the
    server, its log, and each scheduler's (drained, dropped). Checks the stop's bound and that
    nothing crashed."""
    server = _server(tiny_llama, tmp_path, *more, spawned=spawned)
    try:
        for seed in range(prompts):
            server.generate(prompt(seed, PROMPT), max_new_tokens=1)
        took = _interrupt_while_streaming(server, times=1, events=events)
    finally:
        server.stop()
    log = server.log()
    assert took < STOP_BOUND_S, (took, log[-3000:])
    assert "SIGQUIT" not in log and "crashed" not in log and "Scheduler hit an exception" \
        not in log
    # What was drained is on disk: every whole chunk of the finished prompts.
    records = list((tmp_path / "disk").rglob("*.kvt"))
    assert len(records) >= prompts * (PROMPT // CHUNK), (len(records), log[-3000:])
    return server, log, DRAINED.findall(log)


def test_ctrl_c_while_streaming_stops_in_seconds_and_drains_queued_writes(
        tiny_llama: Path, tmp_path: Path) -> None:
    events: list[str] = []
    server, log, drained = _ctrl_c_after(tiny_llama, tmp_path, 3, events=events, spawned=True)
    assert len(drained) == 1 and drained[0][1] == "0", log[-3000:]
    assert "kvtier: SIGINT: no new requests; in-flight requests get" in log
    # The stream the grace did not let finish ends with an error naming the stop, then
    # [DONE] (it used to just end, as if the answer were complete: issue 74).
    assert len(events) > 2 and events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert "server stopping (SIGINT)" in error["message"] and error["code"] == 503, error
    assert "kvtier: the stop ends 1 requests still running" in log, log[-3000:]
    assert "a response still streaming was cut by the stop" not in log, log[-3000:]
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]
    assert server.proc is not None and server.proc.returncode == 130
    # dependencies' noise kvtier keeps out of the log: SGLang's freeze_gc race, nanobind's
    # leak report at a killed process's exit
    assert "freeze_gc failed: the request raced" in log or "freeze_gc failed" not in log
    assert "nanobind: leaked" not in log


def test_the_prompt_a_stopped_stream_prefilled_is_stored_for_the_next_server(
        tiny_llama: Path, tmp_path: Path) -> None:
    """The request the stop cut is aborted in the scheduler, which stores what it prefilled,
    and the drain writes it: the next server (same disk) hits the prompt (issue 74: "0
    dropped", and nothing of it on disk)."""
    events: list[str] = []
    _, log, drained = _ctrl_c_after(tiny_llama, tmp_path, 0, events=events)
    assert "error" in json.loads(events[-2]), events[-3:]
    assert len(drained) == 1 and drained[0][1] == "0", log[-3000:]
    # The next server reads the disk alone for it (the stopped server's CPU tier is gone).
    nxt = _server(tiny_llama, tmp_path, log="next.log", policy="wait_complete")
    try:
        got = nxt.generate(STREAMED, max_new_tokens=1)
    finally:
        nxt.kill()
    assert got["meta_info"]["cached_tokens"] >= PROMPT - CHUNK, (got["meta_info"],
                                                                 nxt.log()[-3000:])


def test_every_data_parallel_scheduler_drains_at_ctrl_c(tiny_llama: Path, tmp_path: Path) -> None:
    """At --dp-size 2 each scheduler keeps its own queue of writes: the launcher waits for
    both, and each says what it drained (issue 51: the drain with DP > 1 was untested; the
    DP controller's death SIGKILLed both schedulers mid-drain)."""
    _, log, drained = _ctrl_c_after(tiny_llama, tmp_path, 4, "--dp-size", "2")
    assert len(drained) == 2 and all(d[1] == "0" for d in drained), log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_a_second_ctrl_c_forces_the_stop(tiny_llama: Path, tmp_path: Path) -> None:
    server = _server(tiny_llama, tmp_path)
    try:
        took = _interrupt_while_streaming(server, times=2)
    finally:
        server.stop()
    log = server.log()
    assert took < STOP_BOUND_S, (took, log[-3000:])
    # uvicorn stopped waiting for the stream: no grace period ran out
    assert "timeout graceful shutdown exceeded" not in log, log[-3000:]
    assert "SIGQUIT" not in log
    # the launcher does not wait for a scheduler the second Ctrl-C stopped, and says what
    # that cost (or the scheduler drained first, when the SIGTERM reached it before)
    assert "still draining" not in log, log[-3000:]
    assert "schedulers stopped before their drain" in log or "queued writes drained" in log


def test_sigterm_takes_sglang_s_graceful_path_and_drains_too(
        tiny_llama: Path, tmp_path: Path) -> None:
    """SIGTERM to the launcher (what an orchestrator sends): SGLang finishes the requests it
    has and stops its schedulers; kvtier drains on the way out, and says so."""
    server = _server(tiny_llama, tmp_path)
    try:
        for seed in range(3):
            server.generate(prompt(seed, PROMPT), max_new_tokens=1)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
    finally:
        server.stop()
    log = server.log()
    drained = DRAINED.search(log)
    assert drained and int(drained[2]) == 0, log[-3000:]
    assert "no write lost before the stop" in log, log[-3000:]  # a healthy disk lost none
    assert "still draining" not in log, log[-3000:]  # the scheduler reported its drain done
    assert "stopped before their drain" not in log, log[-3000:]  # and was not killed first
    assert len(list((tmp_path / "disk").rglob("*.kvt"))) >= 3 * (PROMPT // CHUNK)
    assert "nanobind: leaked" not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_the_launcher_reports_an_interrupt_as_130_whatever_uvicorn_re_raises(
        sig: signal.Signals, status: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit status is set when the signal arrives: a CI run saw uvicorn end without
    re-raising the SIGINT it stopped on, and the launcher exited 0."""
    import uvicorn

    from kvtier.integration.sglang.stop import shutdown
    from kvtier.integration.sglang.stop.http_stop import bound_http_grace

    class Server(uvicorn.Server):  # patched here only, never uvicorn's own class
        pass

    bound_http_grace(Server)
    monkeypatch.setattr(shutdown, "_launcher_pid", [os.getpid()])
    monkeypatch.setattr(shutdown, "_exit_code", [0])
    server = Server(uvicorn.Config(app=None))
    server.handle_exit(sig, None)
    assert server.should_exit and server.config.timeout_graceful_shutdown == GRACE_S
    assert shutdown._exit_code == [status]
