"""Shared fixtures: real redis-server processes on free loopback ports.

The process helpers (`RedisProcess`, `RedisCluster`, `create_cluster`, `free_port`, ...) live
in harness/redis.py, which benchmarks import too: import them from there. Without
`redis-server` on PATH these fixtures fail (they never skip): install it with
`apt-get install redis-server`.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness.redis import (
    RedisCluster,
    RedisProcess,
    RedisSentinel,
    RedisTLSCluster,
    RedisTLSSentinel,
    TLSSentinelProcess,
    binary,
    cluster_node_args,
    create_cluster,
    wait_for,
)
from tests.support.budget import SuiteBudget, budget_from_env


def pytest_configure(config: pytest.Config) -> None:
    """The suite's time budget and per-module table (tests/support/budget.py)."""
    config.pluginmanager.register(SuiteBudget(budget_from_env()), "kvtier-suite-budget")


# The longest modules first (tests/README.md's table, longest first), then every module that
# starts servers or builds, then the rest: with two workers (`make test`: pytest-xdist, whole
# modules each) the long ones start at once and the quick ones fill the gaps at the end,
# instead of one worker finishing a long module alone.
LONGEST_FIRST = tuple(f"tests/{name}.py" for name in (
    "integration/sglang/test_sglang_quality", "integration/sglang/test_sglang_shutdown",
    "demo/test_demo", "test_install", "integration/sglang/test_sglang_blending"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def weight(item: pytest.Item) -> int:
        name = item.nodeid.split("::")[0]
        if name in LONGEST_FIRST:
            return LONGEST_FIRST.index(name)
        heavy = item.get_closest_marker("sglang") or item.get_closest_marker("slow")
        return len(LONGEST_FIRST) + (0 if heavy else 1)

    module: dict[str, int] = {}  # a module's weight is its heaviest test's: it stays whole
    for item in items:
        name = item.nodeid.split("::")[0]
        module[name] = min(module.get(name, len(LONGEST_FIRST) + 1), weight(item))
    items.sort(key=lambda item: module[item.nodeid.split("::")[0]])  # stable


@pytest.fixture(scope="session")
def redis_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RedisProcess]]:
    """`make(**RedisProcess kwargs)` -> a started server, stopped at the end of the session."""
    started: list[RedisProcess] = []

    def make(**kwargs: Any) -> RedisProcess:
        server = RedisProcess(tmp_path_factory.mktemp("redis"), **kwargs)
        started.append(server)
        server.start()
        return server

    try:
        yield make
    finally:
        for server in started:
            server.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def redis_server(redis_factory: Callable[..., RedisProcess]) -> RedisProcess:
    """A plain standalone server (`.url`, `.port`, `.pid`, `.unix_path`, `.stop()/.start()`).

    Shared by the session: a test that stops it must start it again.
    """
    return redis_factory()


@pytest.fixture(scope="session")
def redis_auth_server(redis_factory: Callable[..., RedisProcess]) -> RedisProcess:
    """A server with `requirepass` and an ACL user `kvuser`/`kvpass` allowed everything."""
    server = redis_factory(password="s3cret-pw")
    server.client().execute_command("ACL", "SETUSER", "kvuser", "on", ">kvpass", "~*", "&*",
                                    "+@all")
    return server


@pytest.fixture(scope="session")
def redis_tls_server(
    redis_factory: Callable[..., RedisProcess], tmp_path_factory: pytest.TempPathFactory,
) -> RedisProcess:
    """A TLS-only server with a self-signed certificate for localhost/127.0.0.1 made here."""
    tls = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [binary("openssl"), "req", "-x509", "-newkey", "ec", "-pkeyopt",
         "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(tls / "key.pem"), "-out",
         str(tls / "cert.pem"), "-days", "2", "-subj", "/CN=localhost", "-addext",
         "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True)
    shutil.copy(tls / "cert.pem", tls / "ca.pem")
    return redis_factory(tls_dir=tls)


@pytest.fixture(scope="session")
def redis_cluster(redis_factory: Callable[..., RedisProcess]) -> RedisCluster:
    """A 3-master cluster made with `redis-cli --cluster create`."""
    return create_cluster([redis_factory(args=cluster_node_args()) for _ in range(3)])


@pytest.fixture(scope="session")
def redis_sentinel(redis_factory: Callable[..., RedisProcess]) -> RedisSentinel:
    """A master and one sentinel monitoring it as `kvmaster` (quorum 1)."""
    master = redis_factory()
    sentinel = redis_factory(sentinel_conf=(
        f"sentinel monitor kvmaster 127.0.0.1 {master.port} 1\n"
        "sentinel down-after-milliseconds kvmaster 5000\n"))

    def knows_master() -> bool:
        addr = sentinel.client().execute_command("SENTINEL", "get-master-addr-by-name",
                                                 "kvmaster")
        return addr is not None and int(addr[1]) == master.port

    wait_for("the sentinel to report its master", knows_master)
    return RedisSentinel(master, sentinel, "kvmaster")


@pytest.fixture(scope="session")
def redis_tls_cluster(redis_factory: Callable[..., RedisProcess],
                      redis_tls_server: RedisProcess) -> RedisTLSCluster:
    """A 3-master cluster with `--tls-cluster yes` and TLS-only client ports (the certificate
    of `redis_tls_server`, valid for 127.0.0.1), made with `redis-cli --tls --cluster create`."""
    tls = redis_tls_server.tls_dir
    assert tls is not None
    nodes = [redis_factory(tls_dir=tls, args=(
        "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", "5000", "--tls-cluster", "yes"))
        for _ in range(3)]
    subprocess.run([binary("redis-cli"), "--tls", "--cacert", f"{tls}/ca.pem", "--cluster",
                    "create", *[f"127.0.0.1:{n.port}" for n in nodes], "--cluster-replicas",
                    "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)

    def ready() -> bool:
        infos = [n.client().execute_command("CLUSTER", "INFO") for n in nodes]
        return all(b"cluster_state:ok" in i and b"cluster_known_nodes:3" in i for i in infos)

    wait_for("cluster_state:ok on all TLS nodes", ready)
    return RedisTLSCluster(nodes)


@pytest.fixture(scope="session")
def redis_tls_sentinel(
    redis_factory: Callable[..., RedisProcess], redis_tls_server: RedisProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisTLSSentinel]:
    """A TLS master (password `tls-master-pw`) and a TLS sentinel (password
    `tls-sentinel-pw`) monitoring it as `kvtls` (quorum 1), with the `redis_tls_server`
    certificate."""
    tls = redis_tls_server.tls_dir
    assert tls is not None
    master = redis_factory(tls_dir=tls, password="tls-master-pw")
    sentinel = TLSSentinelProcess(
        tmp_path_factory.mktemp("sentinel-tls"), tls_dir=tls, password="tls-sentinel-pw",
        sentinel_conf=(f"requirepass tls-sentinel-pw\n"
                       f"sentinel monitor kvtls 127.0.0.1 {master.port} 1\n"
                       "sentinel auth-pass kvtls tls-master-pw\n"
                       "sentinel down-after-milliseconds kvtls 5000\n"))
    sentinel.start()
    try:
        def knows_master() -> bool:
            state = sentinel.client().execute_command("SENTINEL", "master", "kvtls")
            fields = dict(zip(state[::2], state[1::2]))
            return (int(fields[b"port"]) == master.port
                    and b"disconnected" not in fields[b"flags"]
                    and b"s_down" not in fields[b"flags"])

        wait_for("the TLS sentinel to report its master", knows_master)
        yield RedisTLSSentinel(master, sentinel, "kvtls")
    finally:
        sentinel.stop(signal.SIGKILL)
