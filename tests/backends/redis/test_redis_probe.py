"""The Redis tier's start-up probe under a tenant's ACL and against a hostile server: it measures
with the ACL of docs/security.md, and a reply nested without end costs one short warning."""

from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.redis import RedisProcess
from kvtier.backends.redis import RedisBackend
from kvtier.backends.redis.inventory import RedisInventory
from kvtier.backends.redis.probe import probe_prefix
from kvtier.config import Config
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage.guard import GuardedTier
from tests.helpers import make_keys

SECURITY_DOC = Path(__file__).resolve().parents[3] / "docs" / "security.md"
NBYTES = 300_000
TENANT_PASSWORD = "tenant-a-test-password"
NESTING = 100_000  # levels of `*1`: far past Python's recursion limit
_DATA_COMMANDS = {b"EXISTS", b"SET", b"GET", b"DEL", b"MGET"}


def _documented_acl() -> list[str]:
    """The `ACL SETUSER ...` words of docs/security.md's tenant paragraph."""
    text = " ".join(SECURITY_DOC.read_text().split())  # the example wraps over lines
    match = re.search(r"`(ACL SETUSER [^`]+)`", text)
    assert match is not None, "docs/security.md no longer shows the tenant ACL"
    return match[1].split()


@pytest.fixture
def tenant_acl(redis_server: RedisProcess) -> Iterator[tuple[str, str]]:
    """The documented tenant user created on the session's server: (user, namespace)."""
    words = _documented_acl()
    user = words[2]
    namespace = next(w for w in words if w.startswith("~")).split("/")[2]
    words = [f">{TENANT_PASSWORD}" if w.startswith(">") else w for w in words]
    admin = redis_server.client()
    admin.execute_command(*words)
    try:
        yield user, namespace
    finally:
        admin.execute_command("ACL", "DELUSER", user)


def test_the_documented_tenant_acl_lets_the_probe_measure(
        make_backend: Callable[..., RedisBackend], redis_server: RedisProcess,
        tenant_acl: tuple[str, str], caplog: pytest.LogCaptureFixture) -> None:
    user, namespace = tenant_acl
    url = f"redis://{user}:{TENANT_PASSWORD}@127.0.0.1:{redis_server.port}"
    backend = make_backend(url, key_namespace=namespace)
    with caplog.at_level(logging.WARNING):
        samples = backend.probe(NBYTES)
    assert "NOPERM" not in caplog.text
    (sample,) = samples
    assert sample.read_bytes == NBYTES and sample.round_trip_s > 0
    assert backend.stats()["errors"] == 0
    # its scratch value is gone, and the tenant's own listing never showed it
    assert not redis_server.client().keys(f"kvtier/v2/{namespace}/*")


class NestingServer:
    """A loopback RESP server that answers the handshake as Redis does and every data command
    with an array nested `NESTING` levels deep."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            try:
                while line := f.readline():
                    words = [f.read(int(f.readline()[1:]) + 2)[:-2]
                             for _ in range(int(line[1:]))]
                    command = words[0].upper()
                    if command in _DATA_COMMANDS:
                        conn.sendall(b"*1\r\n" * NESTING + b":1\r\n")
                    else:
                        conn.sendall(b"+PONG\r\n" if command == b"PING" else b"+OK\r\n")
            except (OSError, ValueError):  # the client hung up mid-reply
                pass

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def nesting_server() -> Iterator[NestingServer]:
    server = NestingServer()
    yield server
    server.close()


def _guarded(backend: RedisBackend) -> GuardedTier:
    """The tier as the engine holds it: failures become misses, logged at a limited rate."""
    return GuardedTier(backend, Counters(), RateLimitedLog(logging.getLogger("kvtier.test")))


def _assert_brief(caplog: pytest.LogCaptureFixture) -> None:
    assert caplog.records, "the failure went unreported"
    assert len(caplog.text.splitlines()) <= 2 * len(caplog.records), caplog.text[:2000]
    assert len(caplog.text) < 1500, caplog.text[:2000]
    assert "Recursion" not in caplog.text


def test_a_deeply_nested_reply_to_the_probe_is_one_short_warning(
        make_backend: Callable[..., RedisBackend], nesting_server: NestingServer,
        caplog: pytest.LogCaptureFixture) -> None:
    backend = make_backend(f"redis://127.0.0.1:{nesting_server.port}")
    with caplog.at_level(logging.WARNING):
        assert _guarded(backend).probe(NBYTES) == []
    _assert_brief(caplog)


def test_a_deeply_nested_reply_to_a_lookup_is_one_short_warning(
        make_backend: Callable[..., RedisBackend], nesting_server: NestingServer,
        caplog: pytest.LogCaptureFixture) -> None:
    backend = make_backend(f"redis://127.0.0.1:{nesting_server.port}")
    with caplog.at_level(logging.WARNING):
        assert _guarded(backend).batch_contains(make_keys(32)) == 0
    _assert_brief(caplog)


def test_a_scratch_value_left_by_a_probe_is_not_listed_as_a_record(
        redis_server: RedisProcess) -> None:
    config = Config(chunk_size=16, max_local_cpu_size=0.016, remote_url=redis_server.url,
                    key_namespace="probe-listing")
    left = f"{probe_prefix(config.key_namespace)}{{7}}/1234-abcdef"  # its DEL never arrived
    client = redis_server.client()
    client.set(left, b"x" * 100, ex=60)
    inventory = RedisInventory(config)
    try:
        assert list(inventory.records(config.key_namespace)) == []
    finally:
        inventory.close()
        client.delete(left)
