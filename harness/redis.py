"""Real redis-server processes on free loopback ports, for tests and benchmarks alike.

Every server runs in its own temporary directory with persistence off, is stopped by pid, and
never touches the system Redis on 6379. Without `redis-server` on PATH these helpers fail
(they never skip): install it with `apt-get install redis-server`. The pytest fixtures that
start them are in tests/conftest.py.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["START_DEADLINE", "RedisCluster", "RedisProcess", "RedisSentinel", "RedisTLSCluster",
           "RedisTLSSentinel", "TLSSentinelProcess", "binary", "cluster_node_args",
           "create_cluster", "free_port", "wait_for"]

START_DEADLINE = 15.0  # seconds; a bound on a hang, not a timing expectation


def cluster_node_args(node_timeout_ms: int = 5000) -> tuple[str, ...]:
    """redis-server arguments of a cluster node (`--cluster-node-timeout`: how long a dead
    master goes unnoticed before its replica is promoted)."""
    return ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms))


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH: the Redis tests need real servers "
                    f"(apt-get install redis-server); they fail rather than skip")
    return path


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(*, cluster: bool = False) -> int:
    """A loopback TCP port nobody listens on right now. A cluster node also needs its bus
    port (+10000) free, and so a port of at most 55535."""
    if not cluster:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20000, 32000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    pytest.fail("no free port pair for a cluster node")


class RedisProcess:
    """One redis-server (or sentinel) on 127.0.0.1:`port`; `stop()`/`start()` for fault tests.

    Attributes: `port`, `pid` (None while stopped), `url` (a kvtier `remote_url`; with the
    password when `password` is set), `workdir`, `unix_path` (a unix socket, plain servers).
    """

    def __init__(self, workdir: Path, *, args: tuple[str, ...] = (), password: str | None = None,
                 tls_dir: Path | None = None, sentinel_conf: str | None = None):
        self.workdir = workdir
        self.port = free_port(cluster="--cluster-enabled" in args)
        self.password = password
        self.tls_dir = tls_dir
        self.unix_path = str(workdir / "redis.sock")
        self._args = args
        self._sentinel_conf = sentinel_conf
        self._proc: subprocess.Popen[bytes] | None = None
        self.logfile = workdir / "redis.log"
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> str:
        creds = f":{self.password}@" if self.password else ""
        if self.tls_dir is not None:
            return f"rediss://{creds}127.0.0.1:{self.port}?ssl_ca_certs={self.tls_dir}/ca.pem"
        return f"redis://{creds}127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        server = binary("redis-server")
        if self._sentinel_conf is not None:
            conf = self.workdir / "sentinel.conf"
            conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                            f"logfile {self.logfile}\n{self._sentinel_conf}")
            return [server, str(conf), "--sentinel"]
        cmd = [server, "--bind", "127.0.0.1", "--dir", str(self.workdir), "--save", "",
               "--appendonly", "no", "--logfile", str(self.logfile), "--daemonize", "no"]
        if self.tls_dir is not None:
            d = self.tls_dir
            cmd += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                    f"{d}/cert.pem", "--tls-key-file", f"{d}/key.pem", "--tls-ca-cert-file",
                    f"{d}/ca.pem", "--tls-auth-clients", "no"]
        else:
            cmd += ["--port", str(self.port), "--unixsocket", self.unix_path,
                    "--unixsocketperm", "700"]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd + list(self._args)

    def start(self) -> None:
        """Start the server and wait until its port accepts connections."""
        assert self._proc is None, "already running"
        self._proc = subprocess.Popen(self._command(), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_DEADLINE
        while True:
            if self._proc.poll() is not None:
                log = self.logfile.read_text()[-2000:] if self.logfile.exists() else ""
                self._proc = None
                pytest.fail(f"redis-server on port {self.port} exited at start:\n{log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"redis-server on port {self.port} did not listen in time")
                time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server by pid (SIGKILL for a crash); idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def client(self, **kwargs: Any) -> Any:
        """A plain redis-py client to inspect the server from a test."""
        import redis

        if self.tls_dir is not None:
            kwargs.update(ssl=True, ssl_ca_certs=f"{self.tls_dir}/ca.pem")
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           protocol=2, socket_timeout=5, **kwargs)


class RedisCluster:
    """Cluster nodes with all 16384 slots assigned (masters, and replicas where made so)."""

    def __init__(self, nodes: list[RedisProcess]):
        self.nodes = nodes

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def masters(self) -> dict[int, RedisProcess]:
        """Live masters by port, as the first live node that answers reports them."""
        by_port = {n.port: n for n in self.nodes if n.pid is not None}
        for node in by_port.values():
            try:
                lines = node.client().execute_command("CLUSTER", "NODES").decode().splitlines()
            except Exception:  # a node that is going down: ask another
                continue
            out = {}
            for line in lines:
                fields = line.split()
                port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                if "master" in fields[2] and "fail" not in fields[2] and port in by_port:
                    out[port] = by_port[port]
            return out
        return {}


def wait_for(what: str, check: Callable[[], bool], timeout: float = START_DEADLINE) -> None:
    """Poll `check` until it holds; fail the test (naming `what`) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def create_cluster(nodes: list[RedisProcess], replicas: int = 0) -> RedisCluster:
    """Join started `--cluster-enabled` nodes into a cluster (`redis-cli --cluster create`),
    `replicas` per master, and wait until every node reports it whole."""
    subprocess.run([binary("redis-cli"), "--cluster", "create",
                    *[f"127.0.0.1:{n.port}" for n in nodes], "--cluster-replicas",
                    str(replicas), "--cluster-yes"], check=True, capture_output=True,
                   timeout=120)
    cluster = RedisCluster(nodes)
    known = f"cluster_known_nodes:{len(nodes)}".encode()

    def ready() -> bool:
        infos = [n.client().execute_command("CLUSTER", "INFO") for n in nodes]
        masters = cluster.masters()
        return all(b"cluster_state:ok" in i and known in i for i in infos) \
            and len(masters) == len(nodes) // (1 + replicas) \
            and all(_replicas_online(m) >= replicas for m in masters.values())

    # Replicas count only once in sync: one still waiting for its first copy (Redis delays a
    # diskless sync by 5 s) cannot be promoted, so a failover test would find no successor.
    wait_for(f"a cluster of {len(nodes)} nodes, {replicas} replica(s) per master, in sync",
             ready, timeout=START_DEADLINE + 30)
    return cluster


def _replicas_online(master: RedisProcess) -> int:
    info = master.client().info("replication")
    return sum(1 for k, v in info.items()
               if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")


class RedisSentinel:
    """One master and one sentinel watching it as `service`."""

    def __init__(self, master: RedisProcess, sentinel: RedisProcess, service: str):
        self.master = master
        self.sentinel = sentinel
        self.service = service

    @property
    def url(self) -> str:
        return f"redis-sentinel://127.0.0.1:{self.sentinel.port}/{self.service}"


class RedisTLSCluster(RedisCluster):
    """A `RedisCluster` whose nodes and bus speak only TLS (certificate in `tls_dir`)."""

    @property
    def url(self) -> str:
        tls_dir = self.nodes[0].tls_dir
        return f"{super().url}?ssl=true&ssl_ca_certs={tls_dir}/ca.pem"


class TLSSentinelProcess(RedisProcess):
    """A sentinel listening only on TLS, and reaching its master over TLS."""

    def _command(self) -> list[str]:
        cmd = super()._command()  # writes sentinel.conf with `port N`: moved to tls-port here
        d = self.tls_dir
        conf = self.workdir / "sentinel.conf"
        conf.write_text(conf.read_text() + (
            f"\nport 0\ntls-port {self.port}\ntls-cert-file {d}/cert.pem\n"
            f"tls-key-file {d}/key.pem\ntls-ca-cert-file {d}/ca.pem\n"
            "tls-auth-clients no\ntls-replication yes\n"))
        return cmd


class RedisTLSSentinel(RedisSentinel):
    """A TLS master with `requirepass` and a TLS sentinel with its own `requirepass`.

    `url` carries both passwords and TLS; `master.password` and `sentinel.password` are the
    two secrets."""

    @property
    def url(self) -> str:
        tls_dir = self.sentinel.tls_dir
        return (f"redis-sentinel://:{self.master.password}@127.0.0.1:{self.sentinel.port}/"
                f"{self.service}?ssl=true&ssl_ca_certs={tls_dir}/ca.pem"
                f"&sentinel_password={self.sentinel.password}")
