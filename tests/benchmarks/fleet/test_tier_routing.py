"""The tier-routing benchmark's parts without servers (benchmarks/fleet/bench_tier_routing.py,
gateway.py): its streaming client against a stdlib server that streams as SGLang does (the
output so far) and as SMG over gRPC does (increments, the last token repeated at the close),
the shares it reports, and the gateway's flags. The benchmark itself runs real servers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest

from benchmarks.fleet.bench_tier_routing import stream_generate, summarize
from benchmarks.fleet.gateway import Gateway, grpc_worker_args

ANSWER = [7, 8, 9, 10]


def _chunks(style: str) -> list[dict[str, object]]:
    if style == "sglang":  # each chunk holds the output so far
        return [{"output_ids": ANSWER[:i + 1]} for i in range(len(ANSWER))] + [
            {"output_ids": ANSWER, "meta_info": {"cached_tokens": 32}}]
    return [{"output_ids": [t]} for t in ANSWER] + [  # SMG: increments, then the close
        {"output_ids": [ANSWER[-1]], "meta_info": {"cached_tokens": 32}}]


@pytest.fixture(params=["sglang", "smg"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[dict[str, object]]]]:
    bodies: list[dict[str, object]] = []
    style = request.param

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()
            for chunk in _chunks(style):
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", bodies
    finally:
        httpd.shutdown()


def test_the_answer_is_read_from_either_stream(
        server: tuple[str, list[dict[str, object]]]) -> None:
    url, bodies = server
    got = stream_generate(url, Path("/m"), [1, 2, 3], max_new=len(ANSWER))
    assert got["output_ids"] == ANSWER  # the repeated closing token is not part of it
    assert got["cached"] == 32 and got["prompt"] == 3
    assert got["ttft_s"] >= 0
    assert bodies[0]["model"] == "/m" and bodies[0]["stream"] is True


def test_shares_split_cached_tokens_between_the_device_and_kvtier_tiers() -> None:
    records = [{"ttft_s": 1.0, "prompt": 100, "cached": 60},
               {"ttft_s": 3.0, "prompt": 100, "cached": 20}]
    # kvtier loaded 40 tokens: 3 chunks from its CPU tier, 1 from Redis
    got = summarize(records, {"tokens_loaded": 40.0, "cpu.hit_chunks": 3.0,
                              "redis.hit_chunks": 1.0})
    assert got["shares"] == pytest.approx(
        {"device": 0.2, "cpu": 0.15, "redis": 0.05, "computed": 0.6})
    assert got["mean_ttft_s"] == 2.0 and got["p99_ttft_s"] == 3.0


def test_a_grpc_worker_names_its_own_port_and_publishes_events() -> None:
    args = grpc_worker_args(51234, events_port=5557)
    assert args[:3] == ["--smg-grpc-mode", "--grpc-port", "51234"]
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert config["publisher"] == "zmq" and config["endpoint"] == "tcp://127.0.0.1:5557"


def test_an_unknown_router_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="router"):
        Gateway("nginx", ["http://127.0.0.1:1"], "round_robin", tmp_path / "log")
    assert not (tmp_path / "log").exists()
