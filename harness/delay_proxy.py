"""A loopback TCP proxy that delays every reply, and can cap its bandwidth: a remote server,
made local.

`DelayProxy(upstream_port, delay_s, bytes_per_s=None)` listens on a free 127.0.0.1 port; bytes
from clients go to the upstream at once, bytes from the upstream reach the client `delay_s`
after they arrived (in order, so throughput is kept and only latency grows), like a server one
long round trip away.

With `bytes_per_s` set, the replies also share one link of that bandwidth (every connection of
the proxy together): each piece is cut into slices of at most `SLICE_BYTES`, and a slice is
sent once it is due and once the link has carried it, one "link free at" clock for all
connections (a slice of n bytes takes n / bytes_per_s of it). So N bytes of replies take at
least N / bytes_per_s to arrive, after the first one's delay.

With `upload_bytes_per_s` set, requests (client to upstream) are paced at that rate too, on a
link of their own (uploads of large values over a slow link).

`delay_s` and `bytes_per_s` are plain attributes, read for every piece (`delay_s`, as it
arrives from the upstream) and every slice (`bytes_per_s`): a test turns the tier slow, or fast
again, mid-run. Pieces already waiting keep the due time they got, and replies never overtake
each other: a piece is never due before the one ahead of it.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from types import TracebackType

__all__ = ["DelayProxy", "SLICE_BYTES"]

SLICE_BYTES = 64 * 1024  # the unit the bandwidth cap paces


class DelayProxy:
    def __init__(self, upstream_port: int, delay_s: float, bytes_per_s: float | None = None,
                 host: str = "127.0.0.1", upload_bytes_per_s: float | None = None):
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0 or None, got {bytes_per_s}")
        self.upstream = (host, upstream_port)
        self.delay_s = delay_s
        self.bytes_per_s = bytes_per_s
        # the requests' own link (a link is full duplex): uploads paced at this rate
        self.upload_bytes_per_s = upload_bytes_per_s
        self._up_free_at = 0.0
        self._listener = socket.create_server((host, 0))
        self.port = int(self._listener.getsockname()[1])
        self.requests = 0  # client -> server reads forwarded (a client spoke when it grows)
        self.reply_bytes = 0  # upstream -> client bytes sent on
        self._link_free_at = 0.0  # the bandwidth cap's clock (time.monotonic())
        self._link_lock = threading.Lock()
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
            while data := src.recv(SLICE_BYTES):
                self.requests += 1
                rate = self.upload_bytes_per_s
                if rate is not None:  # one client's uploads at a time in the tests using it
                    self._up_free_at = max(self._up_free_at, time.monotonic()) + len(data) / rate
                    time.sleep(max(0.0, self._up_free_at - time.monotonic()))
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _link_slot(self, nbytes: int, rate: float) -> float:
        """Reserve the shared link for `nbytes`; returns when they have crossed it."""
        with self._link_lock:
            done = max(self._link_free_at, time.monotonic()) + nbytes / rate
            self._link_free_at = done
        return done

    def _send(self, dst: socket.socket, data: bytes) -> None:
        """Send one due piece, paced by `bytes_per_s` when it is set."""
        view = memoryview(data)
        while view:
            rate = self.bytes_per_s
            if rate is None:
                part, view = view, view[:0]
            else:
                part, view = view[:SLICE_BYTES], view[SLICE_BYTES:]
                wait = self._link_slot(len(part), rate) - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            # Counted before it is sent: a client that has read a reply sees it counted.
            with self._lock:
                self.reply_bytes += len(part)
            dst.sendall(part)

    def _delayed_pump(self, src: socket.socket, dst: socket.socket) -> None:
        due: collections.deque[tuple[float, bytes]] = collections.deque()  # in arrival order
        cond = threading.Condition()
        eof = threading.Event()

        def sender() -> None:
            with contextlib.suppress(OSError):
                while True:
                    with cond:
                        while not due and not eof.is_set():
                            cond.wait()
                        if not due:
                            break
                        at, data = due[0]
                        wait = at - time.monotonic()
                        if wait > 0:
                            cond.wait(wait)
                            continue
                        due.popleft()
                    self._send(dst, data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=sender, daemon=True)
        t.start()
        last = 0.0
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                with cond:
                    # Never due before the piece ahead (delay_s may have shrunk meanwhile).
                    last = max(last, time.monotonic() + self.delay_s)
                    due.append((last, data))
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
