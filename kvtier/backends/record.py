"""The record format shared by the disk and Redis tiers: a self-describing header + payload.

Layout (all integers little-endian)::

    fixed prefix (FIXED_SIZE bytes)
        magic b"KVTR" | version u16 | header_len u32 | fmt u8 | dtype 8s (stable name, NUL-padded)
        | shape 4 x u32 | payload_len u64 | segment_bytes u32 | num_tokens u32 | key_len u16
        | payload checksum u64 | header checksum u64
    key string (utf-8, key_len bytes)
    the chunk's own token ids (num_tokens x u32)
    payload (payload_len bytes; segment_bytes > 0 means a reader may find it stored in pieces)

The header checksum (xxh3_64) covers every header byte except itself; the payload checksum
(xxh3_64) covers the payload. `parse_header` validates every field against the requested key
and the engine's layout, so nothing that fails validation ever reaches the arena and a digest
collision can never load another prompt's KV. Every failure is a `CorruptEntry` whose message
names the field. No pickle: a record is plain bytes any version of kvtier can reject safely.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from kvtier.errors import CorruptEntry
from kvtier.keys import ChunkKey
from kvtier.memory import DTYPES, KVLayout, MemoryFormat, MemoryObj, dtype_name

__all__ = [
    "MAGIC", "VERSION", "FIXED_SIZE", "RecordHeader", "encode_header", "header_len",
    "parse_header", "payload_checksum", "payload_hasher", "verify_payload", "expected_header_len",
]

MAGIC = b"KVTR"
VERSION = 1
_FIXED = struct.Struct("<4sHIB8s4IQIIHQQ")
FIXED_SIZE: int = _FIXED.size
_CHECKED = FIXED_SIZE - 8  # the header checksum is the fixed prefix's last 8 bytes
# Plausibility bounds: they keep a corrupt length field from making a reader allocate or read
# absurd amounts before the checksum has been verified.
MAX_KEY_LEN = 4096
MAX_TOKENS = 1 << 20
_FORMATS = {int(f) for f in MemoryFormat}


class RecordHeader(NamedTuple):
    """A parsed, validated header."""

    header_len: int
    fmt: MemoryFormat
    dtype: str  # stable dtype name (kvtier.memory.DTYPES)
    shape: tuple[int, int, int, int]
    payload_len: int
    segment_bytes: int
    checksum: int  # of the payload
    key: str
    tokens: bytes


def payload_checksum(view: memoryview | bytes) -> int:
    """The checksum of a payload (xxh3_64: fast enough never to cap disk or network speed)."""
    return xxhash.xxh3_64_intdigest(view)


def payload_hasher() -> xxhash.xxh3_64:
    """A streaming payload checksum: `update()` with the payload's pieces in order, then
    `intdigest()` equals `payload_checksum` of the whole. Lets I/O code hash each piece while
    it is still in the CPU cache, just before writing it or just after reading it."""
    return xxhash.xxh3_64()


def expected_header_len(key: ChunkKey) -> int:
    """The exact header length of a record stored under `key`."""
    return FIXED_SIZE + len(key.key.encode()) + len(key.tokens)


def encode_header(
    key: ChunkKey, obj: MemoryObj, *, segment_bytes: int = 0, checksum: int | None = None
) -> bytes:
    """The header of a record holding `obj` under `key`.

    Args:
        key: the chunk key; its token count must equal `obj.num_tokens`.
        obj: the payload (read, never modified).
        segment_bytes: 0, or the segment size the payload is stored in (Redis).
        checksum: the payload checksum when the caller computed it already (e.g. overlapped
            with I/O); computed from `obj.byte_view()` when None.

    Raises:
        ValueError: naming `key`, `obj` or `segment_bytes` when they cannot form a record.
    """
    key_bytes = key.key.encode()
    if not key_bytes or len(key_bytes) > MAX_KEY_LEN:
        raise ValueError(f"key: string must be 1..{MAX_KEY_LEN} bytes, got {len(key_bytes)}")
    if len(key.tokens) % 4 or len(key.tokens) // 4 != key.num_tokens:
        raise ValueError(f"key: tokens hold {len(key.tokens)} bytes for {key.num_tokens} tokens")
    if obj.num_tokens != key.num_tokens:
        raise ValueError(f"obj: has {obj.num_tokens} tokens, key {key.key} {key.num_tokens}")
    if not 0 <= segment_bytes < 2**32:
        raise ValueError(f"segment_bytes: must lie in [0, 2**32), got {segment_bytes}")
    shape = tuple(obj.tensor.shape)
    if len(shape) != 4:
        raise ValueError(f"obj: tensor must be 4-D, got shape {shape}")
    if checksum is None:
        checksum = payload_checksum(obj.byte_view())
    hlen = FIXED_SIZE + len(key_bytes) + len(key.tokens)
    dtype = dtype_name(obj.tensor.dtype).encode()
    prefix = _FIXED.pack(MAGIC, VERSION, hlen, int(obj.fmt), dtype, *shape, obj.nbytes,
                         segment_bytes, key.num_tokens, len(key_bytes), checksum, 0)
    body = key_bytes + key.tokens
    hsum = xxhash.xxh3_64_intdigest(prefix[:_CHECKED] + body)
    return prefix[:_CHECKED] + struct.pack("<Q", hsum) + body


def header_len(prefix: bytes | memoryview) -> int:
    """The total header length announced by the first FIXED_SIZE bytes of a record.

    Raises:
        CorruptEntry: short buffer, wrong magic or version, or implausible lengths.
    """
    if len(prefix) < FIXED_SIZE:
        raise CorruptEntry(f"short header: {len(prefix)} < {FIXED_SIZE} bytes")
    fields = _FIXED.unpack_from(prefix)
    magic, version, hlen = fields[0], fields[1], fields[2]
    num_tokens, key_len = fields[11], fields[12]
    if magic != MAGIC:
        raise CorruptEntry(f"magic: {magic!r} != {MAGIC!r}")
    if version != VERSION:
        raise CorruptEntry(f"version: {version} != {VERSION}")
    if not 0 < key_len <= MAX_KEY_LEN or num_tokens > MAX_TOKENS:
        raise CorruptEntry(f"key_len/num_tokens: implausible {key_len}/{num_tokens}")
    if hlen != FIXED_SIZE + key_len + 4 * num_tokens:
        raise CorruptEntry(f"header_len: {hlen} disagrees with key_len and num_tokens")
    return hlen


def read_key(head: bytes | memoryview) -> str:
    """The key string of the record whose header is `head` (at least `header_len` bytes),
    after the header checksum (for listing what a tier holds without knowing its keys).

    Raises:
        CorruptEntry: a bad magic, version, length or header checksum.
    """
    hlen = header_len(head)
    if len(head) < hlen:
        raise CorruptEntry(f"short header: {len(head)} < {hlen} bytes")
    fields = _FIXED.unpack_from(head)
    key_len, hsum = fields[12], fields[14]
    raw = bytes(head[:hlen])
    if xxhash.xxh3_64_intdigest(raw[:_CHECKED] + raw[FIXED_SIZE:]) != hsum:
        raise CorruptEntry("header checksum mismatch")
    return raw[FIXED_SIZE:FIXED_SIZE + key_len].decode(errors="replace")


def parse_header(buf: bytes | memoryview, key: ChunkKey, layout: KVLayout) -> RecordHeader:
    """Parse and validate the header at the start of `buf` (which may continue with payload).

    Every field is checked: magic, version, lengths, the header checksum, the key string, the
    token ids and their count against `key`, and fmt, dtype, shape and payload length against
    `layout.shape(key.num_tokens)` / `layout.nbytes(key.num_tokens)`.

    Raises:
        CorruptEntry: naming the first field that does not match (a short buffer included).
    """
    hlen = header_len(buf)
    if len(buf) < hlen:
        raise CorruptEntry(f"short header: {len(buf)} < {hlen} bytes")
    (_, _, _, fmt, dtype_raw, s0, s1, s2, s3, payload_len, segment_bytes, num_tokens, key_len,
     checksum, hsum) = _FIXED.unpack_from(buf)
    head = bytes(buf[:hlen])
    if xxhash.xxh3_64_intdigest(head[:_CHECKED] + head[FIXED_SIZE:]) != hsum:
        raise CorruptEntry("header checksum mismatch")
    key_end = FIXED_SIZE + key_len
    if head[FIXED_SIZE:key_end] != key.key.encode():
        raise CorruptEntry(f"key: record holds another key than {key.key}")
    n = key.num_tokens
    if num_tokens != n:
        raise CorruptEntry(f"num_tokens: {num_tokens} != {n}")
    if head[key_end:] != key.tokens:
        raise CorruptEntry("tokens: stored token ids differ from the requested ones")
    if fmt not in _FORMATS or fmt != layout.fmt:
        raise CorruptEntry(f"fmt: {fmt} != {int(layout.fmt)}")
    dtype = dtype_raw.rstrip(b"\0").decode("ascii", "replace")
    if dtype not in DTYPES or dtype != dtype_name(layout.dtype):
        raise CorruptEntry(f"dtype: {dtype!r} != {dtype_name(layout.dtype)!r}")
    shape = (s0, s1, s2, s3)
    if shape != layout.shape(n):
        raise CorruptEntry(f"shape: {shape} != {layout.shape(n)}")
    if payload_len != layout.nbytes(n):
        raise CorruptEntry(f"payload_len: {payload_len} != {layout.nbytes(n)}")
    return RecordHeader(hlen, MemoryFormat(fmt), dtype, shape, payload_len, segment_bytes,
                        checksum, key.key, key.tokens)


def verify_payload(header: RecordHeader, view: memoryview | bytes, *,
                   checksum: int | None = None) -> None:
    """Raise `CorruptEntry` unless `view` is exactly the payload `header` describes.

    `checksum`: the payload's checksum when the caller computed it already (`payload_hasher`).
    """
    if len(view) != header.payload_len:
        raise CorruptEntry(f"payload_len: got {len(view)} bytes, expected {header.payload_len}")
    if (payload_checksum(view) if checksum is None else checksum) != header.checksum:
        raise CorruptEntry("payload checksum mismatch")
