"""RESP2 framing for the Redis tier's data path, without copying payloads.

redis-py's command packer copies every argument and its reply parser copies every bulk string.
`CommandWriter` instead packs commands into a list of buffers for `sendall`, large arguments
left as the caller's memoryviews, and `ReplyReader` reads replies from a socket, receiving bulk
payloads with `recv_into` straight into caller memory. Why and how they are used: see
kvtier.backends.redis.io.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["CommandWriter", "ReplyError", "ReplyReader"]

CRLF = b"\r\n"
_ONE_LINE = (b":", b"+", b"-")  # reply kinds that end with their first line
# Buffers below this size are copied into the send buffer: one syscall is cheaper than many.
_INLINE = 64 * 1024
# The read buffer for reply lines and small replies. Whatever part of a payload arrives with
# its length line is copied from here (at most this much per value); the rest is received
# straight into place.
_SCRATCH = 64 * 1024
# `reply()` answers are small (OK, integers, EXEC's lists of them): a bulk announced larger than
# this is a protocol error before anything is allocated, so a broken or hostile server cannot
# choose how much memory a lookup takes. Payloads go through `header()` + `read_into`, into
# objects sized by the layout, never by the server.
MAX_SMALL_BULK = 64 * 1024
# `reply()` answers nest two levels at most (EXEC's list of lists): deeper is a protocol error,
# read without recursion past it, so a hostile server cannot exhaust the stack and have the
# failure logged as a bug with a traceback of thousands of lines.
MAX_NESTING = 8
# The slowest reply rate a call's deadline allows for (`ReplyReader.expect`): far below any
# network a shared cache runs on, so only a stuck or dripping server reaches it.
MIN_BYTES_PER_S = 20e6


class ReplyError(Exception):
    """The server answered with an error reply (`-ERR ...`); the connection stays usable."""


class CommandWriter:
    """Packs RESP2 commands into a list of buffers for `sendall`; large ones stay views."""

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self._buf = bytearray()

    def command(self, *args: bytes | str | memoryview | list[bytes | memoryview]) -> None:
        """One command; an argument given as a list of buffers is sent as their concatenation."""
        self._buf += b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, str):
                arg = arg.encode()
            pieces = arg if isinstance(arg, list) else [arg]
            self._buf += b"$%d\r\n" % sum(len(p) for p in pieces)
            for piece in pieces:
                if len(piece) < _INLINE:
                    self._buf += piece
                else:
                    self.parts.extend((bytes(self._buf), piece))
                    self._buf.clear()
            self._buf += CRLF

    def finish(self) -> list[bytes | memoryview]:
        if self._buf:
            self.parts.append(bytes(self._buf))
            self._buf.clear()
        parts, self.parts = self.parts, []
        return parts


class ReplyReader:
    """Reads RESP2 replies from a socket; bulk payloads can go straight into caller memory."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._buf = bytearray(_SCRATCH)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0
        self._timeout = sock.gettimeout()  # remote_timeout_secs: the bound of one recv
        self._deadline: float | None = None

    def expect(self, nbytes: int) -> None:
        """Start a call: its replies, about `nbytes` long, must be read within the socket's
        timeout plus `nbytes` at `MIN_BYTES_PER_S`, however the bytes trickle in (the socket
        timeout alone bounds each recv, so a server sending a byte a second would hold a call
        for ever). Past the deadline a read raises `TimeoutError`; the caller drops the
        connection, and the tier's failure rule marks it down."""
        if self._timeout is not None:
            self._deadline = time.monotonic() + self._timeout + nbytes / MIN_BYTES_PER_S

    @property
    def pending(self) -> int:
        """Bytes received but not consumed (non-zero means the connection is not reusable)."""
        return self._hi - self._lo

    def _recv_into(self, view: memoryview) -> int:
        deadline = self._deadline
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RedisTimeoutError("Redis did not complete its reply within the call's "
                                        "deadline (remote_timeout_secs plus the reply's size "
                                        f"at {MIN_BYTES_PER_S / 1e6:.0f} MB/s)")
            self._sock.settimeout(min(left, self._timeout or left))
        try:
            n = self._sock.recv_into(view)
        except TimeoutError:
            raise RedisTimeoutError("timeout reading from Redis") from None
        except OSError as exc:
            raise RedisConnectionError(f"error reading from Redis: {exc}") from None
        finally:
            if deadline is not None:
                self._sock.settimeout(self._timeout)
        if n == 0:
            raise RedisConnectionError("connection closed by Redis")
        return n

    def _fill(self) -> None:
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):  # move a partial line to the front (a few bytes)
            self._buf[: self.pending] = bytes(self._view[self._lo : self._hi])
            self._lo, self._hi = 0, self.pending
        self._hi += self._recv_into(self._view[self._hi :])

    def line(self) -> bytes:
        while True:
            end = self._buf.find(CRLF, self._lo, self._hi)
            if end >= 0:
                out = bytes(self._view[self._lo : end])
                self._lo = end + 2
                return out
            if self.pending == len(self._buf):
                raise RedisConnectionError("protocol error: reply line too long")
            self._fill()

    def read_into(self, out: memoryview) -> None:
        """Fill `out` exactly: buffered bytes first, then `recv_into` straight into it."""
        n = min(len(out), self.pending)
        out[:n] = self._view[self._lo : self._lo + n]
        self._lo += n
        while n < len(out):
            n += self._recv_into(out[n:])

    def read_bytes(self, size: int) -> bytes:
        out = bytearray(size)
        self.read_into(memoryview(out))
        return bytes(out)

    def skip(self, size: int) -> None:
        while size > 0:
            step = min(size, _SCRATCH)
            self.read_into(memoryview(bytearray(step)))
            size -= step

    def end_bulk(self) -> None:
        if self.read_bytes(2) != CRLF:
            raise RedisConnectionError("protocol error: bulk string not terminated by CRLF")

    def header(self, kind: bytes) -> int | None:
        """The length of the next `$` bulk or `*` array reply; None for nil."""
        line = self.line()
        if line[:1] == b"-":
            raise ReplyError(line[1:].decode(errors="replace"))
        if line[:1] != kind:
            raise RedisConnectionError(f"protocol error: expected {kind!r}, got {line[:20]!r}")
        size = _number(line)
        return None if size < 0 else size

    def replies(self, n: int) -> list[Any]:
        """The next `n` replies, each as `reply()` gives it. Runs of one-line replies
        (integers, statuses, errors: what lookups and writes answer, by the hundred for a
        prefix's candidate tails) are split off the buffer at once."""
        out: list[Any] = []
        while len(out) < n:
            if self._buf.find(CRLF, self._lo, self._hi) < 0:
                if self.pending == len(self._buf):
                    raise RedisConnectionError("protocol error: reply line too long")
                self._fill()
                continue
            if self._buf[self._lo:self._lo + 1] not in _ONE_LINE:
                out.append(self.reply())
                continue
            last = self._buf.rfind(CRLF, self._lo, self._hi)
            for line in bytes(self._view[self._lo:last]).split(CRLF):
                if len(out) == n or line[:1] not in _ONE_LINE:
                    break
                self._lo += len(line) + 2
                out.append(_number(line) if line[:1] == b":" else line[1:]
                           if line[:1] == b"+" else ReplyError(line[1:].decode(errors="replace")))
        return out

    def reply(self, depth: int = 0) -> Any:
        """A small reply as a value: bytes, int, list, None, or a `ReplyError` (not raised);
        `depth`: how deep in an array it sits (arrays nest `MAX_NESTING` levels at most)."""
        line = self.line()
        kind = line[:1]
        if kind == b"+":
            return line[1:]
        if kind == b"-":
            return ReplyError(line[1:].decode(errors="replace"))
        if kind not in (b":", b"$", b"*"):
            raise RedisConnectionError(f"protocol error: unexpected reply {line[:20]!r}")
        n = _number(line)
        if kind == b":":
            return n
        if n < 0:
            return None
        if kind == b"*":
            if depth >= MAX_NESTING:
                raise RedisConnectionError(f"protocol error: a reply nested over {MAX_NESTING} "
                                           "arrays deep")
            return [self.reply(depth + 1) for _ in range(n)]
        if n > MAX_SMALL_BULK:
            raise RedisConnectionError(f"protocol error: a {n}-byte bulk reply where a small "
                                       f"reply was expected (limit {MAX_SMALL_BULK})")
        data = self.read_bytes(n)
        self.end_bulk()
        return data


def _number(line: bytes) -> int:
    try:
        return int(line[1:])
    except ValueError:
        raise RedisConnectionError(f"protocol error: bad number in {line[:20]!r}") from None

