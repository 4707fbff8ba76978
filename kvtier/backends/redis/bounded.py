"""A total deadline for redis-py's own exchanges: connecting (with its handshake: `HELLO`,
`AUTH`, `CLIENT SETINFO`, `SELECT`) and every reply redis-py reads itself (`PING`, `SCAN`, a
cluster's slot map, a sentinel's answer).

redis-py bounds each `recv` by the socket timeout, so a server that answers a byte at a time,
each within the timeout, holds a call for ever: a server's launch was still blocked after 60 s,
a prefetch worker sat in connect for 90 s, `kvtier info`/`ls`/`purge` hung. Here the connection
class of every client kvtier makes (`bounded`) wraps its socket so that each `recv` waits at
most what is left of the exchange's deadline: `CONNECT_TIMEOUTS` socket timeouts for a
connect and its handshake, one for a reply (small replies: `PING`, `SCAN` pages; kvtier's data
path reads its large replies through `resp.ReplyReader`, with a deadline by size). Past it the
read raises `socket.timeout`, which redis-py turns into its `TimeoutError`, and the tier's
failure rule marks the tier down. Standalone (TCP, TLS, unix socket), Sentinel and cluster
clients (every node's connections, the slot map's reads included) get it.
"""

from __future__ import annotations

import socket
import time
from functools import cache
from typing import Any

__all__ = ["bounded", "CONNECT_TIMEOUTS"]

CONNECT_TIMEOUTS = 3  # TCP (or TLS) connect, then the handshake's round trips


class _Deadline:
    """The deadline of the exchange running on one connection (None between exchanges)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None


class _BoundedSocket:
    """A socket whose reads stop at the connection's exchange deadline; everything else is
    the socket's own."""

    def __init__(self, sock: socket.socket, deadline: _Deadline):
        self._sock = sock
        self._deadline = deadline

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    @property
    def raw(self) -> socket.socket:
        """The socket itself (kvtier's data path bounds its own reads)."""
        return self._sock

    def _bounded(self, read: Any, *args: Any) -> Any:
        at = self._deadline.at
        if at is None:
            return read(*args)
        left = at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the Redis exchange's deadline passed")
        timeout = self._sock.gettimeout()
        self._sock.settimeout(left if timeout is None else min(left, timeout))
        try:
            return read(*args)
        finally:
            self._sock.settimeout(timeout)

    def recv(self, *args: Any) -> Any:
        return self._bounded(self._sock.recv, *args)

    def recv_into(self, *args: Any) -> Any:
        return self._bounded(self._sock.recv_into, *args)


@cache
def bounded(connection_class: type) -> type:
    """`connection_class` (a redis-py connection class) with the deadlines of the module
    docstring; one class per base, so pools and isinstance checks stay stable."""

    class Bounded(connection_class):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._kvtier_deadline = _Deadline()

        def _connect(self) -> Any:
            return _BoundedSocket(super()._connect(), self._kvtier_deadline)

        def _within(self, timeouts: float, call: Any, *args: Any, **kwargs: Any) -> Any:
            deadline = self._kvtier_deadline
            if deadline.at is not None:  # nested (a handshake reads replies): the outer bound
                return call(*args, **kwargs)
            limit = self.socket_timeout or self.socket_connect_timeout
            deadline.at = None if limit is None else time.monotonic() + limit * timeouts
            try:
                return call(*args, **kwargs)
            finally:
                deadline.at = None

        def connect(self, *args: Any, **kwargs: Any) -> Any:
            return self._within(CONNECT_TIMEOUTS, super().connect, *args, **kwargs)

        def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
            return self._within(CONNECT_TIMEOUTS, super().connect_check_health, *args,
                                **kwargs)

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            return self._within(1, super().read_response, *args, **kwargs)

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{connection_class.__name__}"
    return Bounded
