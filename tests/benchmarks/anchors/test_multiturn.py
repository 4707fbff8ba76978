"""The multi-turn driver (benchmarks/anchors/driver.py, bench_multiturn.py) against a stdlib
HTTP server that speaks the part of SGLang's API the driver uses (streaming `/generate` with
token ids, `/flush_cache`) and records what it saw, on its own clock (the same process, so
the same `time.perf_counter`). Nothing here asserts a duration. The last test (marker
`sglang`) drives one real SGLang server with kvtier."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from benchmarks.anchors.bench_multiturn import Conversations, History, parse_args
from benchmarks.anchors.client import RequestError, flush_cache
from benchmarks.anchors.driver import DriverOptions, run_rounds
from benchmarks.anchors.stats import compare_outputs, summarize


@dataclass
class Seen:
    """One request the stand-in served: its prompt, what it answered, when."""

    input_ids: list[int]
    start: float
    end: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0


class FakeSGLang(ThreadingHTTPServer):
    """SGLang's `/generate` (streamed, cumulative `output_ids`, `meta_info` with
    `prompt_tokens` and `cached_tokens`) and `/flush_cache` (HTTP 400 while a request runs,
    as SGLang answers when its timeout ran out). Answers are a function of the prompt, unless
    its `len(prompt)` is in `twist` (then the last token differs); `cached_tokens` is drawn at
    random and recorded; a prompt starting with a token in `slow` takes `slow_s` longer."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        self.flushes: list[float] = []
        self.running = 0
        self.most_running = 0
        self.twist: set[int] = set()
        self.slow: set[int] = set()
        self.slow_s = 0.0
        self.rng = random.Random(7)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, ids: list[int], n: int) -> list[int]:
        out = [(sum(ids) * 31 + i) % 300 + 4 for i in range(n)]
        if len(ids) in self.twist:
            out[-1] += 1
        return out


class _Handler(BaseHTTPRequestHandler):
    server: FakeSGLang

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        if self.path.startswith("/flush_cache"):
            with self.server.lock:
                busy = self.server.running > 0
                if not busy:
                    self.server.flushes.append(time.perf_counter())
            self.send_response(400 if busy else 200)
            self.end_headers()
            self.wfile.write(b"busy" if busy else b"Cache flushed.")
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._generate(body["input_ids"], body["sampling_params"]["max_new_tokens"])

    def _generate(self, ids: list[int], n: int) -> None:
        srv = self.server
        with srv.lock:
            seen = Seen(ids, time.perf_counter())
            seen.cached_tokens = srv.rng.randrange(len(ids))
            seen.output_ids = srv.answer(ids, n)
            srv.running += 1
            srv.most_running = max(srv.most_running, srv.running)
        time.sleep(0.005 + (srv.slow_s if ids[0] in srv.slow else 0.0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(1, n + 1):
            chunk = {"output_ids": seen.output_ids[:i],
                     "meta_info": {"prompt_tokens": len(ids), "cached_tokens":
                                   seen.cached_tokens, "completion_tokens": i}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        with srv.lock:
            seen.end = time.perf_counter()
            srv.running -= 1
            srv.seen.append(seen)


@pytest.fixture()
def fake() -> Iterator[FakeSGLang]:
    server = FakeSGLang()
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


PLAN = Conversations(clients=3, rounds=3, first_input_len=20, turn_input_len=8, output_len=4)


def _round_of(seen: Seen) -> int:
    """Prompt lengths identify the round: 20, then +8 new and +4 answered per round."""
    return (len(seen.input_ids) - PLAN.first_input_len) // 12 + 1


def _opts(**kw: Any) -> DriverOptions:
    return DriverOptions(**{"output_len": PLAN.output_len, "max_in_flight": 2,
                            "request_rate": 500.0, **kw})


def test_the_barrier_and_the_flushes_are_real(fake: FakeSGLang) -> None:
    run = run_rounds(fake.url, History(PLAN, None),
                     _opts(round_barrier=True, flush_between_rounds=True), range(1, 4))
    assert len(fake.seen) == 9 and not any(r.error for r in run.records)
    assert fake.most_running <= 2
    assert len(fake.flushes) == 2 and [f.after_round for f in run.flushes] == [1, 2]
    for r in (2, 3):
        before = [s for s in fake.seen if _round_of(s) == r - 1]
        after = [s for s in fake.seen if _round_of(s) == r]
        flush = fake.flushes[r - 2]
        # Round r-1 all answered, then the flush, then round r's first request.
        assert max(s.end for s in before) <= flush <= min(s.start for s in after)


def test_without_the_barrier_a_client_goes_on_alone(fake: FakeSGLang) -> None:
    history = History(PLAN, None)
    slow_first = PLAN.new_input(0, 1)[0]
    assert slow_first not in {PLAN.new_input(c, 1)[0] for c in (1, 2)}
    fake.slow, fake.slow_s = {slow_first}, 0.3
    run_rounds(fake.url, history, _opts(max_in_flight=3), range(1, 4))
    slow = next(s for s in fake.seen if s.input_ids[0] == slow_first and _round_of(s) == 1)
    others = [s for s in fake.seen if s.input_ids[0] != slow_first and _round_of(s) == 2]
    assert others and all(s.start < slow.end for s in others)
    assert fake.flushes == []
    # Each round's prompt is the previous one, its answer, and the new input.
    for c in range(PLAN.clients):
        for r in (2, 3):
            assert history.prompts[(c, r)] == (history.prompts[(c, r - 1)]
                                               + history.answers[(c, r - 1)]
                                               + PLAN.new_input(c, r))


def test_the_hit_rate_per_round_is_what_the_server_returned(fake: FakeSGLang) -> None:
    run = run_rounds(fake.url, History(PLAN, None), _opts(round_barrier=True), range(1, 4))
    for r in (1, 2, 3):
        served = [s for s in fake.seen if _round_of(s) == r]
        expected = sum(s.cached_tokens for s in served) / sum(len(s.input_ids) for s in served)
        got = summarize([x for x in run.records if x.round == r])
        assert got.hit_rate == pytest.approx(expected)
        assert got.cached_tokens == sum(s.cached_tokens for s in served)
        assert got.requests == 3 and got.failed == 0


def test_a_different_output_is_flagged(fake: FakeSGLang) -> None:
    first = run_rounds(fake.url, History(PLAN, None), _opts(), range(1, 4))
    reference = {(r.client, r.round): r.output_ids for r in first.records}
    again = run_rounds(fake.url, History(PLAN, reference), _opts(), range(1, 4))
    same = compare_outputs(reference, {(r.client, r.round): r.output_ids
                                       for r in again.records})
    assert same.identical and same.compared == 9
    fake.twist = {PLAN.first_input_len + 12}  # every round-2 prompt answers differently
    twisted = run_rounds(fake.url, History(PLAN, reference), _opts(), range(1, 4))
    got = compare_outputs(reference, {(r.client, r.round): r.output_ids
                                      for r in twisted.records})
    assert not got.identical and sorted(got.differing) == [(0, 2), (1, 2), (2, 2)]


def test_the_second_instance_continues_the_conversations(fake: FakeSGLang) -> None:
    history = History(PLAN, None)
    run_rounds(fake.url, history, _opts(round_barrier=True), range(1, 3))
    later = run_rounds(fake.url, history, _opts(round_barrier=True), range(3, 4))
    assert sorted(r.round for r in later.records) == [3, 3, 3]
    assert all(_round_of(s) == 3 for s in fake.seen[6:])


def test_a_failed_flush_stops_the_run_and_a_failed_request_does_not(fake: FakeSGLang) -> None:
    with fake.lock:
        fake.running = 1  # the stand-in now believes a request runs: it refuses to flush
    with pytest.raises(RequestError, match="flush_cache: HTTP 400"):
        flush_cache(fake.url)
    closed = "http://127.0.0.1:9"  # discard port: nothing listens on loopback
    run = run_rounds(closed, History(PLAN, None), _opts(), range(1, 2))
    assert len(run.records) == 3 and all(r.error for r in run.records)
    assert summarize(run.records).failed == 3


def test_flush_without_barrier_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="needs round_barrier"):
        DriverOptions(flush_between_rounds=True)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--flush-between-rounds"])
    assert exc.value.code == 2
    assert "--flush-between-rounds needs --round-barrier" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--arms", "kvtier-cpu"])  # no baseline to take ratios to


@pytest.mark.sglang
def test_the_driver_against_a_real_kvtier_server(tmp_path: Path) -> None:
    """One real SGLang server with kvtier (CPU tier): the driver's streaming client, its
    flush between rounds and SGLang's `cached_tokens`, end to end. Round 2 runs after a
    flush, so what it finds cached came from kvtier."""
    import yaml

    from harness.sglang_server import running
    from kvtier.demo.models import make_llama

    model = make_llama(tmp_path / "model")
    config = tmp_path / "kvtier.yaml"
    config.write_text(yaml.safe_dump({"chunk_size": 16, "max_local_cpu_size": 0.05,
                                      "prefetch_policy": "wait_complete"}))
    plan = Conversations(clients=2, rounds=2, first_input_len=64, turn_input_len=16,
                         output_len=4)
    args = ["--enable-kvtier", "--kvtier-config-file", str(config)]
    with running(model, tmp_path / "server.log", args=args) as server:
        run = run_rounds(server.url, History(plan, None),
                         DriverOptions(output_len=4, round_barrier=True,
                                       flush_between_rounds=True), range(1, 3))
    assert [r.error for r in run.records] == ["", "", "", ""]
    assert len(run.flushes) == 1
    assert all(len(r.output_ids) == 4 for r in run.records)
    first = summarize([r for r in run.records if r.round == 1])
    second = summarize([r for r in run.records if r.round == 2])
    assert first.cached_tokens == 0 and first.prompt_tokens == 2 * 64
    assert second.prompt_tokens == 2 * (64 + 4 + 16)
    assert second.cached_tokens >= 2 * 64  # at least round 1's prompts, from kvtier
