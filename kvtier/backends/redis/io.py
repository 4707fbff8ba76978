"""The Redis tier's data path: RESP2 commands and replies moved without copying payloads.

redis-py (with hiredis) stays in charge of connections, auth, TLS and routing, but its command
packer copies every argument and its reply parser copies every bulk string, which caps large
values well below what loopback can do (measurements in benchmarks/micro/bench_redis.py). So records
are written with payload memoryviews handed straight to `sendall`, and replies are read with
`recv_into` straight into arena memory. Only connections used in lockstep are handed here, so
redis-py's parser has nothing buffered when we take over the socket. The RESP2 framing itself
is in kvtier.backends.redis.resp.

A chunk is stored as a record (kvtier.backends.record): its header plus payload in one key, or,
when the payload is larger than the segment size, header + segment 0 in the main key and
segment i in `<main>#i`. All of a chunk's keys share one hash tag (the digest), so a cluster
keeps them in one slot, and they are written in one MULTI/EXEC (atomic, and unlike MSET it can
carry a TTL).

Reads come in two kinds (`GetStream(split=...)`): one MGET of a chunk's keys (atomic), or one
GET per segment, requested a few MiB ahead of the reader. Redis builds a command's whole reply
in freshly allocated memory before sending any of it, so an MGET of a 32 MiB chunk costs the
server 32 MiB of page-faulted buffers per read, which caps it well below loopback speed; small
GETs kept a few MiB ahead let it reuse the same warm buffers (about 1.5x on 32 MiB chunks,
benchmarks/micro/bench_redis.py). Split reads are not atomic, but they never yield half a chunk:
every record is checked against the payload checksum in its header (and its GCM tag when it is
encrypted), and the caller re-reads a record that fails the check with one MGET before calling
it corrupt, since a concurrent overwrite or expiry can mix or drop the segments of a sound
record. With a record key, a record is written from a buffer holding its ciphertext (the one
copy encryption costs a put) and read piece by piece into a scratch buffer that is decrypted
into arena memory while it is still in the CPU cache.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from kvtier.backends import record
from kvtier.backends.codec import NAIVE, scratch
from kvtier.backends.redis.resp import CommandWriter, ReplyError, ReplyReader
from kvtier.errors import CorruptEntry
from kvtier.keys import ChunkKey, redis_names
from kvtier.memory import KVLayout, MemoryObj

# CommandWriter, ReplyReader and ReplyError are part of this module's interface (write_record
# takes a writer, GetStream.next returns a reader, read_record raises ReplyError).
__all__ = ["ArenaFull", "CipherBuffers", "CommandWriter", "GetStream", "ReplyError", "ReplyReader",
           "SegmentMismatch", "exchange", "pooled_reader", "raw_socket", "read_atomic",
           "read_record", "redis_keys", "segments", "write_record"]


# Bytes read and verified (checksummed, decrypted) at a time: a segment larger than this is
# read in pieces, so each is still in the CPU cache when it is verified.
PIECE = 1 << 20


class CipherBuffers:
    """Buffers the ciphertext of encrypted records is written into before it is sent, kept for
    the next put: a fresh buffer costs page faults and the kernel's zeroing on every put, which
    halved the put throughput of 32 MiB chunks (2 cores, benchmarks/micro/bench_redis.py). At most
    `keep` bytes of them are kept (one buffer however large). Thread-safe."""

    def __init__(self, keep: int):
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """A buffer of `nbytes` bytes (contents undefined), until `give` returns it."""
        with self._lock:
            fits = [b for b in self._free if len(b) >= nbytes]
            if fits:
                buf = min(fits, key=len)
                self._free.remove(buf)
                return memoryview(buf)[:nbytes]
        return memoryview(bytearray(nbytes))

    def give(self, views: list[memoryview]) -> None:
        """Return buffers from `take`; the largest are kept, up to `keep` bytes in all."""
        given = [v.obj for v in views]
        with self._lock:
            pool = [*self._free, *(b for b in given if isinstance(b, bytearray))]
            pool.sort(key=len, reverse=True)
            self._free, total = [], 0
            for buf in pool:
                if not self._free or total + len(buf) <= self._keep:
                    self._free.append(buf)
                    total += len(buf)


class ArenaFull(Exception):
    """No arena memory for a record that was found; the reply is left half-read."""


class SegmentMismatch(CorruptEntry):
    """A valid record written with another segment size than this reader asked for."""


def redis_keys(key: ChunkKey, nseg: int) -> list[str]:
    """The Redis keys of a chunk stored in `nseg` pieces; the digest is the hash tag."""
    return redis_names(key.key, nseg)


def segments(payload_len: int, seg_bytes: int) -> list[tuple[int, int]]:
    """(start, end) of each stored piece of a payload; one piece when it fits a segment."""
    if payload_len <= seg_bytes:
        return [(0, payload_len)]
    return [(s, min(s + seg_bytes, payload_len)) for s in range(0, payload_len, seg_bytes)]


def segment_bytes(payload_len: int, nseg: int, seg_bytes: int) -> int:
    """The segment size of a record of `payload_len` bytes kept in `nseg` keys (0: one key).

    Readers plan a chunk's keys from its uncompressed size (they cannot know a record's codec
    before reading it), so a compressed payload keeps the naive record's key count, cut into
    `nseg` even segments; `seg_bytes` when that makes `nseg` pieces (a naive record, as ever).
    A payload too small to cut so keeps `seg_bytes`: readers then count a segment mismatch."""
    if nseg <= 1:
        return 0
    if payload_len > (nseg - 1) * seg_bytes:
        return seg_bytes
    even = -(-payload_len // nseg)
    return even if -(-payload_len // even) == nseg else seg_bytes


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
        value: list[bytes | memoryview] | memoryview = (
            [head, payload[start:end]] if i == 0 else payload[start:end])
        out.command("SET", rkeys[i], value, *ex)
    out.command("EXEC")
    return len(pieces) + 2


def read_record(stream: GetStream, key: ChunkKey, layout: KVLayout, nseg: int,
                allocate: Callable[[int], MemoryObj | None],
                keys: record.RecordKeys | None = None) -> MemoryObj | None:
    """Read the replies to the GET, MGET or GETs of a record's `nseg` keys into a new object,
    decrypting it there, piece by piece, when it is encrypted (`keys`: the reader's record
    keys; see `record.open_payload` for what each reader may load).

    Returns None when the key is absent (its replies are fully consumed). The caller owns the
    returned object. Raises CorruptEntry (not a valid record for `key`, `SegmentMismatch`, or
    a `record.ForgedEntry`), ArenaFull, ReplyError or redis-py's connection errors; after any
    of them the replies may be half-read, so the connection must be dropped.
    """
    split = stream.split and nseg > 1
    reader = stream.next()
    if nseg > 1 and not split and reader.header(b"*") != nseg:
        raise CorruptEntry(f"MGET answered with another count than {nseg} keys")
    size = reader.header(b"$")
    if size is None:
        for _ in range(nseg - 1):  # the main key is gone; skip what is left of its segments
            orphan = (stream.next() if split else reader).header(b"$")
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
    unseal = record.open_payload(head, keys)  # KeyMismatch before anything is allocated
    obj = allocate(key.num_tokens)
    if obj is None:
        raise ArenaFull(key.key)
    try:
        # Another codec's payload is verified in a scratch buffer, then decoded into `obj`.
        naive = head.codec is NAIVE
        view = obj.byte_view() if naive else scratch(head.payload_len)
        for i, (start, end) in enumerate(pieces):
            if i and (stream.next() if split else reader).header(b"$") != end - start:
                raise CorruptEntry(f"segment {i} is missing or has the wrong length")
            for at in range(start, end, PIECE):  # each piece verified while in the CPU cache
                piece = view[at:min(at + PIECE, end)]
                stored = unseal.landing(piece)
                reader.read_into(stored)
                unseal.update(stored, piece)
            reader.end_bulk()
        record.verify_payload(head, view, unseal=unseal)
        if not naive:
            head.codec.decode(view, obj)
    except BaseException:
        obj.release()
        raise
    return obj


def read_atomic(client: redis.Redis, key: ChunkKey, rkeys: list[str], layout: KVLayout,
                allocate: Callable[[int], MemoryObj | None],
                keys: record.RecordKeys | None = None) -> MemoryObj | None:
    """`read_record` of one record with one MGET (or GET) on its own pooled connection."""
    stream = GetStream(client, 0)
    try:
        stream.add(rkeys, 0)
        obj = read_record(stream, key, layout, len(rkeys), allocate, keys)
        stream.done()
        return obj
    finally:
        stream.close()


def raw_socket(conn: Any) -> socket.socket:
    # redis-py keeps the connected socket (plain, TLS or unix) in `_sock`; the data path uses
    # it directly because no public call sends a memoryview or reads into caller memory.
    sock = conn._sock
    if sock is None:
        raise RedisConnectionError("connection not open")
    return getattr(sock, "raw", sock)  # past `bounded`'s wrapper: these reads bound themselves


@contextmanager
def pooled_reader(client: redis.Redis, nbytes: int = 0,
                  ) -> Iterator[tuple[Any, ReplyReader]]:
    """A pooled connection of `client` and a `ReplyReader` on its socket whose call must be
    read within the deadline for `nbytes` (`ReplyReader.expect`). The connection goes back
    to the pool, dropped unless the reader consumed every byte it received."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        reader = ReplyReader(raw_socket(conn))
        reader.expect(nbytes)
        yield conn, reader
    except BaseException:
        conn.disconnect()
        raise
    else:
        if reader.pending:  # a reply half-read: the socket is out of step
            conn.disconnect()
    finally:
        pool.release(conn)


def exchange(client: redis.Redis, parts: list[bytes | memoryview],
             counts: list[int]) -> list[list[Any]]:
    """Send pipelined commands on one pooled connection; their small replies, grouped by
    `counts` (replies per logical operation). Error replies are values, not raised.

    The call's deadline charges the bytes sent as a read charges the bytes received
    (`ReplyReader.expect`): a large batch of puts over a slow link is given the time its
    upload takes at the floor rate, instead of failing after Redis stored it."""
    sent = sum(len(p) for p in parts)
    with pooled_reader(client, sent) as (conn, reader):
        conn.send_packed_command(parts, check_health=False)
        flat = iter(reader.replies(sum(counts)))
        return [[next(flat) for _ in range(n)] for n in counts]


class GetStream:
    """Pipelined reads on one pooled connection of one node, replies read in order.

    At most `window` reply bytes are requested ahead of the reader, so Redis never has to
    buffer a whole batch of large values in its output buffer. With `split`, a record stored
    in several keys is read with one GET per key (see the module docstring), else with one MGET.
    """

    def __init__(self, client: redis.Redis, window: int, split: bool = False):
        self.client = client
        self.split = split
        self._window = window
        self._todo: deque[tuple[tuple[str, ...], int]] = deque()
        self._sent: deque[int] = deque()
        self._inflight = 0
        self._conn: Any = None
        self._reader: ReplyReader | None = None
        self._clean = True

    def add(self, rkeys: list[str], nbytes: int) -> None:
        """Queue the read of one record of about `nbytes` payload bytes stored in `rkeys`."""
        if len(rkeys) == 1:
            self._todo.append((("GET", rkeys[0]), nbytes))
        elif self.split:
            each = -(-nbytes // len(rkeys))  # an estimate is enough to bound the window
            self._todo.extend((("GET", k), each) for k in rkeys)
        else:
            self._todo.append((("MGET", *rkeys), nbytes))

    def next(self) -> ReplyReader:
        """The reader, positioned at the next reply; call `done()` once a record's replies
        are fully read."""
        if self._conn is None:
            self._conn = self.client.connection_pool.get_connection()
            self._reader = ReplyReader(raw_socket(self._conn))
        out = CommandWriter()
        while self._todo and (not self._sent or
                              self._inflight + self._todo[0][1] <= self._window):
            command, nbytes = self._todo.popleft()
            out.command(*command)
            self._sent.append(nbytes)
            self._inflight += nbytes
        parts = out.finish()
        if parts:
            self._conn.send_packed_command(parts, check_health=False)
        nbytes = self._sent.popleft()
        self._inflight -= nbytes
        self._clean = False
        assert self._reader is not None
        self._reader.expect(nbytes)  # this record's deadline
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
        self.client.connection_pool.release(self._conn)
        self._conn = None
