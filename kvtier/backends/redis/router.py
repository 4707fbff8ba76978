"""The redis-py clients for a parsed `remote_url`: `Router` holds them (one client, a Sentinel's
master, or a cluster's nodes) and routes a key to the client of its node.

Parsing the URL into a `RedisTarget` is kvtier.backends.redis.url, which touches no network;
constructing a `Router` does for a cluster (redis-py reads the slot map at once).
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, ConnectionPool, SSLConnection
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection, SentinelManagedSSLConnection

from kvtier.backends.redis.bounded import bounded
from kvtier.backends.redis.url import RedisTarget

__all__ = ["Router"]



def _cluster(target: RedisTarget, common: dict[str, Any]) -> RedisCluster:
    """A cluster client whose nodes' connections are `bounded`. redis-py hands a connection
    class to its nodes only on its from-URL path (otherwise `ssl=True` replaces the class with
    its own), so the first seed goes in as a plain URL and TLS comes from the class."""
    kwargs = dict(common)
    tls = kwargs.pop("ssl", False)
    kwargs["connection_class"] = bounded(SSLConnection if tls else Connection)
    host, port = target.nodes[0]
    seed = f"[{host}]" if ":" in host else host
    seeds = [ClusterNode(h, p) for h, p in target.nodes[1:]]
    return RedisCluster(url=f"redis://{seed}:{port}", startup_nodes=seeds, **kwargs)


class Router:
    """redis-py clients for one target; `node_for` routes a key to the client of its node.

    Construction touches the network only for a cluster (redis-py reads the slot map at once)
    and raises what redis-py raises when that fails.
    """

    def __init__(self, target: RedisTarget, timeout: float):
        common: dict[str, Any] = {
            **target.kwargs,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # RESP2 keeps replies to GET/MGET byte-for-byte predictable for the raw data path,
            # and switches off RESP3 push messages that could land between replies.
            "protocol": 2,
            # One quick retry for transient errors; a dead server is the health logic's job.
            "retry": Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
        }
        self.target = target
        self._cluster: RedisCluster | None = None
        self._sentinel: Sentinel | None = None
        if target.kind == "standalone":
            common["connection_class"] = bounded(common.get("connection_class", Connection))
            self._client = redis.Redis(connection_pool=ConnectionPool(**common))
        elif target.kind == "sentinel":
            # Sentinels are asked without the data nodes' credentials (with their own from
            # sentinel_username/sentinel_password, and TLS as the data nodes), but with our
            # timeouts and retry (redis-py's default retry would back off for seconds).
            queries = {k: common[k] for k in ("socket_timeout", "socket_connect_timeout",
                                              "retry")}
            queries.update(target.sentinel_kwargs)
            self._sentinel = Sentinel(list(target.nodes), sentinel_kwargs=queries, **common)
            managed = SentinelManagedSSLConnection if common.get("ssl") else \
                SentinelManagedConnection
            self._client = self._sentinel.master_for(target.service,
                                                     connection_class=bounded(managed))
        else:
            self._cluster = _cluster(target, common)

    def node_for(self, rkey: str) -> redis.Redis:
        """The client of the node that owns `rkey` (its slot, for a cluster)."""
        if self._cluster is None:
            return self._client
        node = self._cluster.get_node_from_key(rkey)
        return self._cluster.get_redis_connection(node)

    def primaries(self) -> list[redis.Redis]:
        if self._cluster is None:
            return [self._client]
        return [self._cluster.get_redis_connection(n) for n in self._cluster.get_primaries()]

    def ping(self) -> None:
        """PING every primary; raises redis-py's errors when one does not answer."""
        if self._cluster is not None:
            self._cluster.nodes_manager.initialize()  # a node may have moved while we were down
        for client in self.primaries():
            client.ping()

    def refresh(self) -> None:
        """Re-read the slot map after a MOVED/ASK reply (a no-op outside a cluster)."""
        if self._cluster is not None:
            self._cluster.nodes_manager.initialize()

    def disconnect(self) -> None:
        """Drop every pooled connection (they are reopened on next use)."""
        for client in self.primaries():
            client.connection_pool.disconnect()

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
        else:
            self._client.close()
            self._client.connection_pool.disconnect()
        if self._sentinel is not None:
            self._sentinel.close()
