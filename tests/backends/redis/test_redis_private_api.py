"""The private redis-py internals the Redis tier relies on, checked against real servers.

pyproject.toml caps redis-py below 9 because of these. When a test here fails after a redis-py
upgrade, adapt kvtier/backends/redis (io.raw_socket, router.Router) before widening the pin.
"""

from __future__ import annotations

import redis
from redis.cluster import ClusterNode, NodesManager, RedisCluster

from harness.redis import RedisCluster as ClusterProcesses
from harness.redis import RedisProcess
from kvtier.backends.redis.io import ReplyReader, raw_socket

VERSION = f"redis-py {redis.__version__}"


def test_pooled_connection_exposes_its_socket(redis_server: RedisProcess) -> None:
    client = redis_server.client()
    conn = client.connection_pool.get_connection()  # no command name: redis-py >= 5.3
    try:
        sock = getattr(conn, "_sock", None)
        assert callable(getattr(sock, "recv_into", None)), (
            f"{VERSION}: Connection._sock is {sock!r}, not a connected socket with recv_into; "
            "kvtier.backends.redis.io.raw_socket reads replies from it")
        # The data path hands send_packed_command a list of buffers, memoryviews included,
        # then reads the reply from _sock itself.
        conn.send_packed_command([b"*1\r\n$4\r\n", memoryview(b"PING"), b"\r\n"],
                                 check_health=False)
        reply = ReplyReader(raw_socket(conn)).reply()
        assert reply == b"PONG", (f"{VERSION}: PING sent with Connection.send_packed_command "
                                  f"and read from Connection._sock gave {reply!r}")
    finally:
        client.connection_pool.release(conn)
        client.close()


def test_cluster_slot_map_can_be_reread(redis_cluster: ClusterProcesses) -> None:
    assert callable(getattr(NodesManager, "initialize", None)), (
        f"{VERSION}: redis.cluster.NodesManager.initialize is gone; "
        "kvtier.backends.redis.router.Router.refresh/ping call it")
    node = redis_cluster.nodes[0]
    cluster = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", node.port)], protocol=2)
    try:
        manager = getattr(cluster, "nodes_manager", None)
        assert isinstance(manager, NodesManager), (
            f"{VERSION}: RedisCluster.nodes_manager is {manager!r}, not a NodesManager")
        manager.initialize()  # what Router.refresh does after MOVED/ASK
        assert len(cluster.get_primaries()) == len(redis_cluster.nodes)
    finally:
        cluster.close()
