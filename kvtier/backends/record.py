"""The record format shared by the disk and Redis tiers: a self-describing header + payload.

Layout (all integers little-endian)::

    fixed prefix (FIXED_SIZE bytes)
        magic b"KVTR" | version u16 | header_len u32 | fmt u8 | dtype 8s (stable name, NUL-padded)
        | shape 4 x u32 | payload_len u64 | segment_bytes u32 | num_tokens u32 | key_len u16
        | flags u8 | payload checksum u64 | header checksum u64
    key string (utf-8, key_len bytes)
    token digest (32 bytes): SHA-256 of the key string and the chunk's token ids
    MAC (32 bytes): HMAC-SHA256 of the payload and the header before it, when flags has
        `AUTHENTICATED`; zeros otherwise
    payload (payload_len bytes; segment_bytes > 0 means a reader may find it stored in pieces)

The header checksum (xxh3_64) covers every header byte except itself; the payload checksum
(xxh3_64) covers the payload. `parse_header` validates every field against the requested key
and the engine's layout, so nothing that fails validation ever reaches the arena and a digest
collision can never load another prompt's KV. The token ids themselves are not stored: the
digest verifies them without telling a reader of the record what the prompt was.

Checksums catch accidents, not a neighbour who can write the tier: with a record key (a secret
shared by the instances, `record_key_file`), every record carries a MAC, and a reader holding
the key loads only records whose MAC verifies; a reader without a key loads no authenticated
record (either is a `ForgedEntry`: a counted miss that no reader deletes). Every failure
is a `CorruptEntry` whose message names the field. No pickle: a record is plain bytes any
version of kvtier can reject safely (version 1 records are rejected by their version).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
from typing import NamedTuple

import xxhash

from kvtier.errors import ConfigError, CorruptEntry
from kvtier.keys import ChunkKey
from kvtier.memory import DTYPES, KVLayout, MemoryFormat, MemoryObj, dtype_name

__all__ = [
    "MAGIC", "VERSION", "FIXED_SIZE", "RecordHeader", "Seal", "ForgedEntry", "encode_header",
    "header_len", "parse_header", "payload_checksum", "verify_payload", "expected_header_len",
    "token_digest", "MIN_KEY_BYTES", "load_record_key",
]


MAGIC = b"KVTR"
VERSION = 2
_FIXED = struct.Struct("<4sHIB8s4IQIIHBQQ")
FIXED_SIZE: int = _FIXED.size
_CHECKED = FIXED_SIZE - 8  # the header checksum is the fixed prefix's last 8 bytes
DIGEST = 32
MAC = 32
AUTHENTICATED = 1  # flags bit: the MAC field holds a MAC
MIN_KEY_BYTES = 16  # a record key shorter than this is refused
# Plausibility bounds: they keep a corrupt length field from making a reader allocate or read
# absurd amounts before the checksum has been verified.
MAX_KEY_LEN = 4096
MAX_TOKENS = 1 << 20
_FORMATS = {int(f) for f in MemoryFormat}


class ForgedEntry(CorruptEntry):
    """A record whose MAC does not match this reader's record key: missing or wrong (a writer
    without the key, or with another key), or present where this reader holds no key. A miss,
    counted, and never deleted: a reader with a stale or mistyped key must not erase a cache
    its fleet shares, and nobody loads what they cannot verify."""


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
    mac: bytes  # b"" when the record is not authenticated
    signed: bytes  # the header bytes the MAC covers (after the payload)


def payload_checksum(view: memoryview | bytes) -> int:
    """The checksum of a payload (xxh3_64: fast enough never to cap disk or network speed)."""
    return xxhash.xxh3_64_intdigest(view)


class Seal:
    """A payload's checksum, and its MAC when `mac_key` is given, computed piece by piece:
    `update()` with the payload's pieces in order, so I/O code hashes each piece while it is
    still in the CPU cache, just before writing it or just after reading it."""

    def __init__(self, mac_key: bytes | None = None):
        self._sum = xxhash.xxh3_64()
        self._mac = hmac.new(mac_key, digestmod=hashlib.sha256) if mac_key else None

    def update(self, piece: memoryview | bytes) -> None:
        self._sum.update(piece)
        if self._mac is not None:
            self._mac.update(piece)

    @property
    def checksum(self) -> int:
        return int(self._sum.intdigest())

    def mac(self, signed: bytes) -> bytes:
        """The MAC of the payload so far followed by `signed` (header bytes); b"" without a
        key."""
        if self._mac is None:
            return b""
        final = self._mac.copy()
        final.update(signed)
        return final.digest()


def load_record_key(path: str | None) -> bytes | None:
    """The record key in file `path` (surrounding whitespace dropped); None without a path.

    Raises:
        ConfigError: naming `record_key_file` (never the key) when the file cannot be read,
            holds fewer than `MIN_KEY_BYTES` bytes, or is open to the group or others (a
            mode other than 0600 or 0400).
    """
    if not path:
        return None
    full = os.path.expanduser(path)
    try:
        with open(full, "rb") as f:
            data = f.read(1 << 16).strip()
            mode = os.fstat(f.fileno()).st_mode
    except OSError as exc:
        raise ConfigError(f"record_key_file: cannot read {path!r}: "
                          f"{exc.strerror or exc}") from None
    if len(data) < MIN_KEY_BYTES:
        raise ConfigError(f"record_key_file: {path!r} holds {len(data)} bytes; a record key "
                          f"needs at least {MIN_KEY_BYTES} (e.g. `head -c 32 /dev/urandom | "
                          f"base64 > {path}`)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"record_key_file: {path!r} is open to other users (mode "
                          f"{stat.S_IMODE(mode):03o}); whoever reads it can forge records and "
                          f"whoever writes it can change the key: chmod 600 {path}")
    return data


def token_digest(key: ChunkKey) -> bytes:
    """What a record stores to verify `key.tokens` (never the tokens themselves)."""
    return hashlib.sha256(key.key.encode() + b"\0" + key.tokens).digest()


def expected_header_len(key: ChunkKey) -> int:
    """The exact header length of a record stored under `key`."""
    return FIXED_SIZE + len(key.key.encode()) + DIGEST + MAC


def encode_header(key: ChunkKey, obj: MemoryObj, *, segment_bytes: int = 0,
                  seal: Seal | None = None, mac_key: bytes | None = None) -> bytes:
    """The header of a record holding `obj` under `key`.

    Args:
        key: the chunk key; its token count must equal `obj.num_tokens`.
        obj: the payload (read, never modified).
        segment_bytes: 0, or the segment size the payload is stored in (Redis).
        seal: the payload's `Seal` when the caller computed it already (e.g. overlapped with
            I/O); computed from `obj.byte_view()` (with `mac_key`) when None.
        mac_key: the record key; with it the record is authenticated.

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
    if seal is None:
        seal = Seal(mac_key)
        seal.update(obj.byte_view())
    hlen = expected_header_len(key)
    dtype = dtype_name(obj.tensor.dtype).encode()
    prefix = _FIXED.pack(MAGIC, VERSION, hlen, int(obj.fmt), dtype, *shape, obj.nbytes,
                         segment_bytes, key.num_tokens, len(key_bytes),
                         AUTHENTICATED if mac_key else 0, seal.checksum, 0)[:_CHECKED]
    signed = prefix + key_bytes + token_digest(key)
    mac = seal.mac(signed) if mac_key else b"\0" * MAC
    if len(mac) != MAC:
        raise ValueError("seal: made without the record key it is used with")
    body = key_bytes + token_digest(key) + mac
    hsum = xxhash.xxh3_64_intdigest(prefix + body)
    return prefix + struct.pack("<Q", hsum) + body


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
    if hlen != FIXED_SIZE + key_len + DIGEST + MAC:
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
    key_len, hsum = fields[12], fields[15]
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
     flags, checksum, hsum) = _FIXED.unpack_from(buf)
    head = bytes(buf[:hlen])
    if xxhash.xxh3_64_intdigest(head[:_CHECKED] + head[FIXED_SIZE:]) != hsum:
        raise CorruptEntry("header checksum mismatch")
    key_end = FIXED_SIZE + key_len
    if head[FIXED_SIZE:key_end] != key.key.encode():
        raise CorruptEntry(f"key: record holds another key than {key.key}")
    n = key.num_tokens
    if num_tokens != n:
        raise CorruptEntry(f"num_tokens: {num_tokens} != {n}")
    digest_end = key_end + DIGEST
    if not hmac.compare_digest(head[key_end:digest_end], token_digest(key)):
        raise CorruptEntry("tokens: the record was stored for other token ids")
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
    mac = head[digest_end:digest_end + MAC] if flags & AUTHENTICATED else b""
    return RecordHeader(hlen, MemoryFormat(fmt), dtype, shape, payload_len, segment_bytes,
                        checksum, key.key, mac, head[:_CHECKED] + head[FIXED_SIZE:digest_end])


def verify_payload(header: RecordHeader, view: memoryview | bytes, *,
                   seal: Seal | None = None, mac_key: bytes | None = None) -> None:
    """Raise `CorruptEntry` unless `view` is exactly the payload `header` describes, and
    `ForgedEntry` if `mac_key` is given and the record's MAC is missing or wrong.

    `seal`: the payload's `Seal` (made with `mac_key`) when the caller computed it already.
    """
    if len(view) != header.payload_len:
        raise CorruptEntry(f"payload_len: got {len(view)} bytes, expected {header.payload_len}")
    if seal is None:
        seal = Seal(mac_key)
        seal.update(view)
    if seal.checksum != header.checksum:
        raise CorruptEntry("payload checksum mismatch")
    if not mac_key and header.mac:
        # Never loaded unverified: the writers hold a key this reader lacks.
        raise ForgedEntry("mac: the record is authenticated with a record key this reader "
                          "does not hold (set the same record_key_file on every instance)")
    if mac_key:
        if not header.mac:
            raise ForgedEntry("mac: the record is not authenticated (written without the "
                              "record key)")
        if not hmac.compare_digest(seal.mac(header.signed), header.mac):
            raise ForgedEntry("mac: does not verify (the record was made or changed without "
                              "the record key)")
