"""The test proxy itself: replies arrive intact, in order, no sooner than its delay and its
bandwidth cap allow, with both changeable while it runs.

Every time asserted is a lower bound the proxy enforces with its own sleeps (a reply is never
sent before it is due, N bytes never cross a link of R bytes/s in less than N/R); nothing is
asserted about how fast anything is.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import pytest

from harness.delay_proxy import DelayProxy
from harness.redis import RedisProcess

MB = 1_000_000
RATE = 4 * MB  # bytes/s


def _client(proxy: DelayProxy) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=proxy.port, protocol=2, socket_timeout=60)


@pytest.fixture
def value(redis_server: RedisProcess) -> bytes:
    data = os.urandom(2 * MB)
    redis_server.client().set("delay-proxy:big", data)
    return data


def test_bandwidth_cap_paces_a_large_reply(redis_server: RedisProcess, value: bytes) -> None:
    with DelayProxy(redis_server.port, 0.0, bytes_per_s=RATE) as proxy:
        client = _client(proxy)
        start = time.monotonic()
        got = client.get("delay-proxy:big")
        took = time.monotonic() - start
        client.close()
    assert got == value
    assert took >= 0.9 * len(value) / RATE, took  # 2 MB at 4 MB/s: 0.5 s at least


def test_delay_applies_to_every_reply(redis_server: RedisProcess) -> None:
    with DelayProxy(redis_server.port, 0.3) as proxy:
        client = _client(proxy)
        for _ in range(2):
            start = time.monotonic()
            assert client.ping()
            assert time.monotonic() - start >= 0.3
        client.close()


def test_connections_share_one_link(redis_server: RedisProcess, value: bytes) -> None:
    """Two clients reading 2 MB each at once get 4 MB through a 4 MB/s link: 1 s at least."""
    got: list[bytes] = []

    def read(proxy: DelayProxy) -> None:
        client = _client(proxy)
        got.append(client.get("delay-proxy:big"))
        client.close()

    with DelayProxy(redis_server.port, 0.0, bytes_per_s=RATE) as proxy:
        threads = [threading.Thread(target=read, args=(proxy,)) for _ in range(2)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        took = time.monotonic() - start
    assert got == [value, value]
    assert took >= 0.9 * 2 * len(value) / RATE, took


def test_delay_and_cap_change_while_running(redis_server: RedisProcess, value: bytes) -> None:
    with DelayProxy(redis_server.port, 0.0) as proxy:
        client = _client(proxy)  # one connection, kept across the changes
        assert client.get("delay-proxy:big") == value
        proxy.bytes_per_s = RATE
        start = time.monotonic()
        assert client.get("delay-proxy:big") == value
        assert time.monotonic() - start >= 0.9 * len(value) / RATE
        proxy.bytes_per_s = None
        proxy.delay_s = 0.3
        start = time.monotonic()
        assert client.ping()
        assert time.monotonic() - start >= 0.3
        proxy.delay_s = 0.0
        assert client.get("delay-proxy:big") == value
        assert proxy.reply_bytes > 3 * len(value)
        client.close()


def test_a_shorter_delay_never_reorders_replies(redis_server: RedisProcess) -> None:
    """The second command is sent after the delay dropped to 0: its reply still comes second."""
    with DelayProxy(redis_server.port, 0.5) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
        sock.sendall(b"ECHO first\r\n")
        deadline = time.monotonic() + 30
        while proxy.requests < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # let the first reply reach the proxy's queue
        proxy.delay_s = 0.0
        sock.sendall(b"ECHO second\r\n")
        want = b"$5\r\nfirst\r\n$6\r\nsecond\r\n"
        got = b""
        while len(got) < len(want) and (chunk := sock.recv(4096)):
            got += chunk
    assert got == want


@pytest.mark.parametrize("kwargs", [{"delay_s": -1.0}, {"delay_s": 0.0, "bytes_per_s": 0},
                                    {"delay_s": 0.0, "bytes_per_s": -5.0}])
def test_rejects_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        DelayProxy(1, **kwargs)
