"""Loads from a slow tier run in the background: a running stream never waits for them.

Server A stores long prompts in a real Redis. The other servers reach that Redis through a
proxy that delays every reply (a remote Redis), with an empty CPU tier of their own:
  B (wait_complete): a stream keeps its pace while a long prompt's prefix loads, and the long
    request is served from the cache with A's output.
  C (timeout): a request whose load outlasts its budget is admitted with what its CPU tier
    had and still gives the recomputed output; a request aborted during its load leaves
    nothing held.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.delay_proxy import DelayProxy
from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from tests.integration.sglang.conftest import prompt, write_config

pytestmark = pytest.mark.sglang

CHUNK = 64
LONG = 2200  # prompt tokens: 34 whole chunks
# B's Redis replies arrive this late: a scheduler thread that waited on one would stop the stream
# for at least this long, far above what a busy host alone does to a gap (0.44 s seen in CI,
# the long request's own admission step on a 2-core host shared with another server).
STALL_DELAY_S = 2.0
STALL_BOUND_S = 1.0  # a gap this long during the load is a stall, whatever the median
SLOW_DELAY_S = 1.0  # C's: nothing from Redis arrives within a second
BUDGET_MS = 400.0  # C's timeout budget: no Redis read can finish within it
SEEDS = {"stall": 31, "timeout": 32, "abort": 33}
LONG_CONTEXT = ("--context-length", "4096", "--max-total-tokens", "12288")


@pytest.fixture(scope="module")
def redis(redis_factory: Callable[..., RedisProcess]) -> RedisProcess:
    return redis_factory()


def _config(tmp: Path, url: str, **extra: Any) -> Path:
    return write_config(tmp / "kvtier.yaml", chunk_size=CHUNK, max_local_cpu_size=0.2,
                        remote_url=url, remote_timeout_secs=10.0, **extra)


def _long_env() -> dict[str, str]:
    return {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}


@pytest.fixture(scope="module")
def stored(start_server: Callable[..., SGLangServer], tiny_llama4: Path, redis: RedisProcess,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """A's greedy outputs for the long prompts, which are then durable in Redis."""
    server = start_server(tiny_llama4, _config(tmp_path_factory.mktemp("a"), redis.url),
                          *LONG_CONTEXT, env=_long_env())
    outputs = {name: server.generate(prompt(seed, LONG))["output_ids"]
               for name, seed in SEEDS.items()}
    server.flush_cache()  # waits for the Redis writes
    server.stop()
    return outputs


@pytest.fixture(scope="module")
def tiny_llama4(models_dir: Path) -> Path:
    from kvtier.demo.models import make_llama

    return make_llama(models_dir / "tiny-llama-4l", layers=4)


def _stream_times(server: SGLangServer, ids: list[int], n: int, started: threading.Event,
                  times: list[float]) -> None:
    """Stream `n` greedy tokens, recording when each chunk arrived."""
    def arrived() -> None:
        times.append(time.monotonic())
        if len(times) == 20:
            started.set()

    server.stream_generate(ids, n, timeout=300, on_chunk=arrived)


def _admission_lines(log: str) -> str:
    """What the server said about loads, admissions and slow calls: why a stream stopped."""
    keep = ("scheduler thread", "at admission", "Prefill batch", "kvtier: request")
    return "\n".join(line[:300] for line in log.splitlines() if any(k in line for k in keep))


def test_stream_keeps_its_pace_while_a_long_prefix_loads_from_slow_redis(
        start_server: Callable[..., SGLangServer], tiny_llama4: Path, redis: RedisProcess,
        stored: dict[str, list[int]], tmp_path: Path) -> None:
    with DelayProxy(redis.port, STALL_DELAY_S) as proxy:
        server = start_server(tiny_llama4, _config(tmp_path, proxy.url,
                                                   prefetch_policy="wait_complete"),
                              *LONG_CONTEXT, env=_long_env())
        times: list[float] = []
        started = threading.Event()
        streamer = threading.Thread(target=_stream_times, args=(
            server, prompt(99, 64), 1000, started, times))
        streamer.start()
        assert started.wait(120), "the stream never started"
        long_ids = prompt(SEEDS["stall"], LONG)
        sent = time.monotonic()
        got = server.generate(long_ids)
        answered = time.monotonic()
        streamer.join(300)

    median = statistics.median(b - a for a, b in zip(times[5:], times[6:]))
    during = [(b - a, a - sent) for a, b in zip(times, times[1:]) if b >= sent and a <= answered]
    assert during, "the long request was served after the stream ended"
    gap, at = max(during)
    assert gap <= max(4 * median, STALL_BOUND_S), (
        f"the stream stopped for {gap:.3f}s (median gap {median:.4f}s), {at:.3f}s after the "
        f"long request was sent ({answered - sent:.3f}s before it was answered); the server's "
        f"log:\n{_admission_lines(server.log())}")
    assert got["meta_info"]["cached_tokens"] >= 0.8 * LONG
    assert got["output_ids"] == stored["stall"]
    assert "loads from lower tiers run in the background" in server.log()


@pytest.fixture(scope="module")
def slow_server(start_server: Callable[..., SGLangServer], tiny_llama4: Path,
                redis: RedisProcess, stored: dict[str, list[int]],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SGLangServer,
                                                                             DelayProxy]]:
    with DelayProxy(redis.port, SLOW_DELAY_S) as proxy:
        cfg = _config(tmp_path_factory.mktemp("c"), proxy.url, prefetch_policy="timeout",
                      prefetch_timeout_base_ms=BUDGET_MS, prefetch_timeout_per_token_ms=0.0)
        yield start_server(tiny_llama4, cfg, *LONG_CONTEXT, env=_long_env()), proxy


def test_request_aborted_during_its_prefetch_frees_what_it_held(
        slow_server: tuple[SGLangServer, DelayProxy], stored: dict[str, list[int]]) -> None:
    server, proxy = slow_server
    rid = uuid.uuid4().hex
    before = proxy.requests
    body = {"rid": rid, "input_ids": prompt(SEEDS["abort"], LONG),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}}
    result: dict[str, Any] = {}
    request = threading.Thread(target=lambda: result.update(server.post("/generate", body)))
    request.start()
    deadline = time.monotonic() + 60
    while proxy.requests == before:  # the prefetch's reads reached Redis: it is running
        assert time.monotonic() < deadline, "the prefetch never read from Redis"
        time.sleep(0.01)
    server.post("/abort_request", {"rid": rid})
    request.join(60)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"

    found = server.wait_for_log(r"dropped (\d+) of the (\d+) chunks a cancelled prefetch "
                                r"brought up [^;]*; arena holds (\d+) bytes \((\d+) when it "
                                r"started\)")
    _, _, held, start = found[-1]
    assert held == start
    assert re.search(rf"request {rid} aborted; the tree protects 0 tokens", server.log())


def test_load_over_its_budget_is_admitted_with_what_arrived(
        slow_server: tuple[SGLangServer, DelayProxy], stored: dict[str, list[int]]) -> None:
    server, _ = slow_server
    ids = prompt(SEEDS["timeout"], LONG)
    server.generate(ids[: 10 * CHUNK + 5])  # computed here: its 10 chunks are in C's CPU tier
    server.flush_cache()
    got = server.generate(ids)
    # Admitted when the budget ran out: with what the CPU tier holds (the 10 chunks and the
    # tail of the short prompt but its last token), none from Redis.
    assert got["meta_info"]["cached_tokens"] == 10 * CHUNK + 4
    assert got["output_ids"] == stored["timeout"]
