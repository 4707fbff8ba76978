"""A loopback TCP proxy that delays every reply by a fixed time: a remote server, made local.

`DelayProxy(upstream_port, delay_s)` listens on a free 127.0.0.1 port; bytes from clients go to
the upstream at once, bytes from the upstream reach the client `delay_s` after they arrived (in
order, so throughput is kept and only latency grows), like a server one long round trip away.
"""

from __future__ import annotations

import contextlib
import heapq
import socket
import threading
import time
from types import TracebackType

__all__ = ["DelayProxy"]


class DelayProxy:
    def __init__(self, upstream_port: int, delay_s: float, host: str = "127.0.0.1"):
        self.upstream = (host, upstream_port)
        self.delay_s = delay_s
        self._listener = socket.create_server((host, 0))
        self.port = int(self._listener.getsockname()[1])
        self.requests = 0  # client -> server reads forwarded (a client spoke when it grows)
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [client, server]
            self._spawn(self._forward, client, server)
            self._spawn(self._delayed_pump, server, client)

    def _spawn(self, target: object, *args: socket.socket) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                self.requests += 1
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _delayed_pump(self, src: socket.socket, dst: socket.socket) -> None:
        due: list[tuple[float, int, bytes]] = []
        cond = threading.Condition()
        seq = 0
        eof = threading.Event()

        def sender() -> None:
            with contextlib.suppress(OSError):
                while True:
                    with cond:
                        while not due and not eof.is_set():
                            cond.wait()
                        if not due:
                            break
                        at, _, data = due[0]
                        wait = at - time.monotonic()
                        if wait > 0:
                            cond.wait(wait)
                            continue
                        heapq.heappop(due)
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=sender, daemon=True)
        t.start()
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                with cond:
                    heapq.heappush(due, (time.monotonic() + self.delay_s, seq, data))
                    seq += 1
                    cond.notify()
        with cond:
            eof.set()
            cond.notify()
        t.join()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
