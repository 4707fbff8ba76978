"""The Redis tier's data path: RESP2 commands and replies moved without copying payloads.

redis-py (with hiredis) stays in charge of connections, auth, TLS and routing, but its command
packer copies every argument and its reply parser copies every bulk string, which caps large
values well below what loopback can do (measurements in benchmarks/bench_redis.py). So records
are written with payload memoryviews handed straight to `sendall`, and replies are read with
`recv_into` straight into arena memory. Only connections used in lockstep are handed here, so
redis-py's parser has nothing buffered when we take over the socket.

A chunk is stored as a record (kvtier.backends.record): its header plus payload in one key, or,
when the payload is larger than the segment size, header + segment 0 in the main key and
segment i in `<main>#i`. All of a chunk's keys share one hash tag (the digest), so a cluster
keeps them in one slot, and they are written in one MULTI/EXEC (atomic, and unlike MSET it can
carry a TTL) and read with one MGET (atomic): a reader sees the whole chunk or nothing.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.backends import record
from kvtier.errors import CorruptEntry
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryObj

__all__ = ["ArenaFull", "CommandWriter", "GetStream", "ReplyError", "ReplyReader",
           "SegmentMismatch", "exchange", "read_record", "redis_keys", "segments", "write_record"]

CRLF = b"\r\n"
# Buffers below this size are copied into the send buffer: one syscall is cheaper than many.
_INLINE = 64 * 1024
# The read buffer for reply lines and small replies. Whatever part of a payload arrives with
# its length line is copied from here (at most this much per value); the rest is received
# straight into place.
_SCRATCH = 64 * 1024


class ReplyError(Exception):
    """The server answered with an error reply (`-ERR ...`); the connection stays usable."""


class ArenaFull(Exception):
    """No arena memory for a record that was found; the reply is left half-read."""


class SegmentMismatch(CorruptEntry):
    """A valid record written with another segment size than this reader asked for."""


def redis_keys(key: ChunkKey, nseg: int) -> list[str]:
    """The Redis keys of a chunk stored in `nseg` pieces; the digest is the hash tag."""
    prefix, _, digest = key.key.rpartition("/")
    main = f"{prefix}/{{{digest}}}"
    return [main] + [f"{main}#{i}" for i in range(1, nseg)]


def segments(payload_len: int, seg_bytes: int) -> list[tuple[int, int]]:
    """(start, end) of each stored piece of a payload; one piece when it fits a segment."""
    if payload_len <= seg_bytes:
        return [(0, payload_len)]
    return [(s, min(s + seg_bytes, payload_len)) for s in range(0, payload_len, seg_bytes)]


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

    @property
    def pending(self) -> int:
        """Bytes received but not consumed (non-zero means the connection is not reusable)."""
        return self._hi - self._lo

    def _recv_into(self, view: memoryview) -> int:
        try:
            n = self._sock.recv_into(view)
        except TimeoutError:
            raise RedisTimeoutError("timeout reading from Redis") from None
        except OSError as exc:
            raise RedisConnectionError(f"error reading from Redis: {exc}") from None
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

    def reply(self) -> Any:
        """A small reply as a value: bytes, int, list, None, or a `ReplyError` (not raised)."""
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
            return [self.reply() for _ in range(n)]
        data = self.read_bytes(n)
        self.end_bulk()
        return data


def _number(line: bytes) -> int:
    try:
        return int(line[1:])
    except ValueError:
        raise RedisConnectionError(f"protocol error: bad number in {line[:20]!r}") from None


def write_record(out: CommandWriter, rkeys: list[str], head: bytes, payload: memoryview,
                 seg_bytes: int, ttl: int | None) -> int:
    """Append the command(s) storing one record; returns how many replies they produce."""
    ex = ["EX", str(ttl)] if ttl else []
    pieces = segments(len(payload), seg_bytes)
    if len(pieces) == 1:
        out.command("SET", rkeys[0], [head, payload], *ex)
        return 1
    out.command("MULTI")
    for i, (start, end) in enumerate(pieces):
        value = [head, payload[start:end]] if i == 0 else payload[start:end]
        out.command("SET", rkeys[i], value, *ex)
    out.command("EXEC")
    return len(pieces) + 2


def read_record(reader: ReplyReader, key: ChunkKey, layout: KVLayout, nseg: int,
                allocate: Callable[[int], MemoryObj | None]) -> MemoryObj | None:
    """Read the reply to a GET (`nseg == 1`) or MGET of a record's keys into a new object.

    Returns None when the key is absent (the reply is fully consumed). The caller owns the
    returned object. Raises CorruptEntry (not a valid record for `key`, or `SegmentMismatch`),
    ArenaFull, ReplyError or redis-py's connection errors; after any of them the reply may be
    half-read, so the connection must be dropped.
    """
    if nseg > 1 and reader.header(b"*") != nseg:
        raise CorruptEntry(f"MGET answered with another count than {nseg} keys")
    size = reader.header(b"$")
    if size is None:
        for _ in range(nseg - 1):  # the main key is gone; skip what is left of its segments
            orphan = reader.header(b"$")
            if orphan is not None:
                reader.skip(orphan + 2)
        return None
    hlen = record.expected_header_len(key)
    if size < hlen:
        raise CorruptEntry(f"value of {size} bytes is shorter than a header")
    head = record.parse_header(reader.read_bytes(hlen), key, layout)
    seg = head.segment_bytes or head.payload_len
    if -(-head.payload_len // seg) != nseg:  # checked before building a list of pieces
        raise SegmentMismatch(f"record stored in segments of {head.segment_bytes} bytes")
    pieces = segments(head.payload_len, seg)
    if size != hlen + pieces[0][1]:
        raise CorruptEntry(f"value length {size} != header + first segment")
    obj = allocate(key.num_tokens)
    if obj is None:
        raise ArenaFull(key.key)
    try:
        view = obj.byte_view()
        for i, (start, end) in enumerate(pieces):
            if i and reader.header(b"$") != end - start:
                raise CorruptEntry(f"segment {i} is missing or has the wrong length")
            reader.read_into(view[start:end])
            reader.end_bulk()
        record.verify_payload(head, view)
    except BaseException:
        obj.release()
        raise
    return obj


def _socket(conn: Any) -> socket.socket:
    # redis-py keeps the connected socket (plain, TLS or unix) in `_sock`; the data path uses
    # it directly because no public call sends a memoryview or reads into caller memory.
    sock = conn._sock
    if sock is None:
        raise RedisConnectionError("connection not open")
    return sock


def exchange(client: redis.Redis, parts: list[bytes | memoryview],
             counts: list[int]) -> list[list[Any]]:
    """Send pipelined commands on one pooled connection; their small replies, grouped by
    `counts` (replies per logical operation). Error replies are values, not raised."""
    pool = client.connection_pool
    conn = pool.get_connection()
    clean = False
    try:
        conn.send_packed_command(parts, check_health=False)
        reader = ReplyReader(_socket(conn))
        out = [[reader.reply() for _ in range(n)] for n in counts]
        clean = reader.pending == 0
        return out
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)


class GetStream:
    """Pipelined GET/MGETs on one pooled connection of one node, replies read in order.

    At most `window` reply bytes are requested ahead of the reader, so Redis never has to
    buffer a whole batch of large values in its output buffer.
    """

    def __init__(self, client: redis.Redis, window: int):
        self._client = client
        self._window = window
        self._todo: deque[tuple[list[str], int]] = deque()
        self._sent: deque[int] = deque()
        self._inflight = 0
        self._conn: Any = None
        self._reader: ReplyReader | None = None
        self._clean = True

    def add(self, rkeys: list[str], nbytes: int) -> None:
        self._todo.append((rkeys, nbytes))

    def next(self) -> ReplyReader:
        """The reader, positioned at the next reply; call `done()` once it is fully read."""
        assert self._clean, "previous reply not fully read"
        if self._conn is None:
            self._conn = self._client.connection_pool.get_connection()
            self._reader = ReplyReader(_socket(self._conn))
        out = CommandWriter()
        while self._todo and (not self._sent or
                              self._inflight + self._todo[0][1] <= self._window):
            rkeys, nbytes = self._todo.popleft()
            out.command("GET" if len(rkeys) == 1 else "MGET", *rkeys)
            self._sent.append(nbytes)
            self._inflight += nbytes
        parts = out.finish()
        if parts:
            self._conn.send_packed_command(parts, check_health=False)
        self._inflight -= self._sent.popleft()
        self._clean = False
        assert self._reader is not None
        return self._reader

    def done(self) -> None:
        self._clean = True

    def close(self) -> None:
        """Return the connection; drop it when replies are left unread (the batch stopped)."""
        if self._conn is None:
            return
        assert self._reader is not None
        if not (self._clean and not self._sent and self._reader.pending == 0):
            self._conn.disconnect()
        self._client.connection_pool.release(self._conn)
        self._conn = None
