"""The fleet behind SMG: two real SGLang servers with kvtier, as SMG's gRPC workers
(`--smg-grpc-mode`, publishing KV events), sharing one Redis, behind a real `smg launch` with
its event-driven `cache_aware` policy on a free loopback port (benchmarks/fleet/gateway.py).

Requests route through the gateway to a worker and come back; SMG subscribed to both workers'
KV event streams; after every device cache is flushed (through the gateway), a repeated prompt is
served with kvtier's cached tokens and the same greedy output; kvtier wrote to the shared Redis.
smg and smg-grpc-servicer come with the `dev` extra (`make setup`): without them this fails.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.fleet.gateway import Gateway, make_grpc_worker, wait_grpc_ready, worker_url
from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from tests.integration.sglang.conftest import CHUNK, prompt, write_config

pytestmark = pytest.mark.sglang

PAGE = 16  # SMG's event-driven index counts blocks of --block-size (16) tokens: one page each
PROMPT = 5 * CHUNK
FULL_HIT = (PROMPT - 1) // PAGE * PAGE  # all but the last prompt token, in whole pages


@pytest.fixture(scope="module")
def fleet(tiny_llama: Path, redis_factory: Callable[..., RedisProcess],
          tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[tuple[Gateway, list[SGLangServer], RedisProcess]]:
    redis = redis_factory()
    work = tmp_path_factory.mktemp("fleet-smg")
    config = write_config(work / "kvtier.yaml", remote_url=redis.url)
    # Built here, not by start_server: a gRPC worker's flags name its own port.
    servers = [make_grpc_worker(SGLangServer(
        tiny_llama, work / f"server-{i}.log", args=["--enable-kvtier", "--kvtier-config-file",
                                                    str(config), "--page-size", str(PAGE)]))
        for i in range(2)]
    gateway: Gateway | None = None
    try:
        for server in servers:  # started side by side
            server.launch()
        for server in servers:
            wait_grpc_ready(server)
        gateway = Gateway("smg", [worker_url(s, grpc=True) for s in servers], "cache_aware",
                          work / "smg.log", model=tiny_llama)
        yield gateway, servers, redis
    finally:
        if gateway is not None:
            gateway.stop()
        for server in servers:
            server.kill()


def _served_by(servers: list[SGLangServer], request_id: str) -> list[int]:
    return [i for i, s in enumerate(servers) if request_id in s.log()]


def test_smg_routes_to_grpc_workers_and_a_repeated_prompt_hits_kvtier(
        fleet: tuple[Gateway, list[SGLangServer], RedisProcess]) -> None:
    gateway, servers, redis = fleet
    log = gateway.log()
    for server in servers:  # event-driven: SMG reads each worker's KV events
        assert re.search(rf"KV event stream connected.*grpc://127\.0\.0\.1:{server.port}",
                         re.sub(r"\x1b\[[0-9;]*m", "", log)), log[-3000:]

    # Distinct prompts: each answered by exactly one worker, with the tokens asked for.
    firsts = {}
    for seed in range(4):
        got = gateway.generate(prompt(200 + seed, PROMPT), max_new_tokens=6)
        assert len(got["output_ids"]) == 6
        assert got["meta_info"]["cached_tokens"] == 0  # nothing cached yet anywhere
        assert len(_served_by(servers, got["meta_info"]["id"])) == 1
        firsts[seed] = got["output_ids"]

    # Every device cache flushed (kvtier's writes land first): a repeat is kvtier's to serve.
    gateway.flush_cache()
    assert int(redis.client().dbsize()) > 0  # the shared tier holds what the servers stored
    for seed in range(4):
        again = gateway.generate(prompt(200 + seed, PROMPT), max_new_tokens=6)
        assert again["output_ids"] == firsts[seed], seed
        assert again["meta_info"]["cached_tokens"] == FULL_HIT, seed
        rid = again["meta_info"]["id"]
        (where,) = _served_by(servers, rid)
        assert f"kvtier: loaded {FULL_HIT} tokens at admission of {rid}" in servers[where].log()
