"""A fleet sharing one Redis Cluster: two real SGLang servers, round-robin over them, on a
3-master cluster with a replica per master; then the master holding the prompt's slots dies.

What one server computed the other loads (>= 80% of the prompt cached, identical output);
after a SIGKILL of that master and its replica's promotion, the same prompt is served on
both servers without a failed request and with the same output (a hit or a recompute).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.redis import (
    RedisCluster,
    RedisProcess,
    cluster_node_args,
    create_cluster,
    wait_for,
)
from harness.sglang_server import SGLangServer
from tests.integration.sglang.conftest import CHUNK, cold, prompt, write_config

pytestmark = pytest.mark.sglang

TURN = 12 * CHUNK + 5


@pytest.fixture(scope="module")
def cluster(redis_factory: Callable[..., RedisProcess]) -> RedisCluster:
    return create_cluster([redis_factory(args=cluster_node_args(2000)) for _ in range(6)],
                          replicas=1)


def test_two_servers_share_a_cluster_and_survive_a_master_failover(
        start_server: Callable[..., SGLangServer], tiny_llama: Path,
        cluster: RedisCluster, tmp_path: Path) -> None:
    # The default policy: the second server's first request hits because the (empty) cluster
    # was timed, on each primary, when the servers started.
    config = write_config(tmp_path / "kvtier.yaml", remote_url=cluster.url,
                          remote_timeout_secs=2.0, prefetch_policy="adaptive")
    servers = [start_server(tiny_llama, config, ready=False) for _ in range(2)]
    for server in servers:  # started side by side
        server.wait_ready()
    ids = prompt(70, TURN)
    expected = cold(servers[0], ids)

    # Round-robin: the first server computes, the second loads what it stored.
    assert servers[0].generate(ids)["output_ids"] == expected
    servers[0].flush_cache()  # waits for the Redis writes
    got = servers[1].generate(ids)  # its first request
    assert got["meta_info"]["cached_tokens"] >= 0.8 * TURN, servers[1].log()[-3000:]
    assert got["output_ids"] == expected
    assert "kvtier: tier redis measured at start" in servers[1].log()

    # The master holding most of the prompt's chunks dies; its replica takes over.
    masters = cluster.masters()
    victim = max(masters.values(), key=lambda m: int(m.client().dbsize()))
    assert int(victim.client().dbsize()) > 0
    victim.stop(signal.SIGKILL)
    wait_for("a replica promoted in place of the killed master",
             lambda: len(cluster.masters()) == 3 and victim.port not in cluster.masters())

    for server in servers:  # no failed request, same output: a hit or a recompute
        server.flush_cache()
        again = server.generate(ids)
        assert again["output_ids"] == expected
    # Hits resume: what the promoted replica holds, or what a server stores again now.
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing assertion
    while True:
        servers[1].flush_cache()
        again = servers[1].generate(ids)
        assert again["output_ids"] == expected
        if again["meta_info"]["cached_tokens"] >= 0.8 * TURN:
            break
        assert time.monotonic() < deadline, "hits never resumed after the failover"
        time.sleep(1.0)
