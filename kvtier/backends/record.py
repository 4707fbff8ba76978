"""The record format shared by the disk and Redis tiers: a self-describing header + payload.

Layout (all integers little-endian)::

    fixed prefix (FIXED_SIZE bytes)
        magic b"KVTR" | version u16 | header_len u32 | fmt u8 | dtype 8s (stable name, NUL-padded)
        | shape 4 x u32 | payload_len u64 | segment_bytes u32 | num_tokens u32 | key_len u16
        | flags u8 | payload checksum u64 | header checksum u64
    key string (utf-8, key_len bytes)
    token digest (32 bytes): SHA-256 of the key string and the chunk's token ids
    seal field (32 bytes): when flags has `ENCRYPTED`, key id (4) | nonce (12) | GCM tag (16)
        (kvtier.backends.sealing); zeros in a plain record
    payload (payload_len bytes, encrypted when flags has `ENCRYPTED`; segment_bytes > 0 means
        a reader may find it stored in pieces)

The header checksum (xxh3_64) covers every header byte except itself; the payload checksum
(xxh3_64) covers the payload as stored (the ciphertext of an encrypted one). `parse_header`
validates every field against the requested key and the engine's layout, so nothing that fails
validation ever reaches the arena and a digest collision can never load another prompt's KV.
The token ids themselves are not stored: the digest verifies them.

But the payload is the KV, and layer 0's V rows give the prompt back to anyone holding the
model's weights. With a record key (`record_key_file`, a secret shared by the instances) every
record is encrypted with AES-256-GCM, authenticated together with its header (the associated
data: every header byte but the two checksums and the seal field, then the key id); a reader
holding keys loads only records encrypted under one of them, a reader without keys loads no
encrypted record (either is a `ForgedEntry`: a counted miss that no reader deletes). Every
other failure is a `CorruptEntry` whose message names the field.

Codec: the flags byte's high 4 bits name the payload's codec (`kvtier.backends.codec`: 0
naive, 1 fp8, 2 int8); the low 4 bits are the seal bits below. `payload_len` is the codec's,
while dtype and shape stay the pool's (what the record decodes to). kvtier versions before
codecs read a non-zero codec as unknown flag bits: `OtherVersion`, a counted miss left in
place, never a load of bytes they cannot decode; a version not knowing a codec id names it.
The codec bits are part of the header checksum and of GCM's associated data, and the payload
checksum and encryption cover the encoded (compressed) bytes.

Flags: `ENCRYPTED` records also set `AUTHENTICATED`, the bit with which kvtier versions before
encryption marked an HMAC-SHA256 in the seal field: such a version, with or without a key,
rejects an encrypted record as forged (kept) instead of loading ciphertext, so the format kept
its version. Records with `AUTHENTICATED` alone (an HMAC, payload in clear) are no longer
written; they are a `ForgedEntry` for every reader. No pickle: a record is plain bytes any
version of kvtier can reject safely (version 1 records are rejected by their version).

The layout's definitions (the struct, flags bits, bounds, `RecordHeader`, digests) are
kvtier.backends.record_layout; this module writes and reads records with them.
"""

from __future__ import annotations

import hmac
import struct

import xxhash

from kvtier.backends.codec import Codec, Encoded, codec_by_id
from kvtier.backends.record_layout import (
    _CHECKED,
    _CODEC_SHIFT,
    _FIXED,
    _FLAGS,
    _FORMATS,
    _PIECE,
    _SEALED,
    AUTHENTICATED,
    DIGEST,
    ENCRYPTED,
    FIXED_SIZE,
    MAC,
    MAGIC,
    MAX_KEY_LEN,
    MAX_TOKENS,
    VERSION,
    RecordHeader,
    Stored,
    _aad,
    expected_header_len,
    payload_checksum,
    token_digest,
)
from kvtier.backends.sealing import (
    MIN_KEY_BYTES,
    ForgedEntry,
    KeyMismatch,
    RecordKeys,
    Seal,
    Unseal,
    load_record_keys,
)
from kvtier.errors import CorruptEntry
from kvtier.keys import ChunkKey
from kvtier.memory import DTYPES, KVLayout, MemoryFormat, dtype_name

__all__ = [
    "MAGIC", "VERSION", "FIXED_SIZE", "RecordHeader", "Seal", "Unseal", "ForgedEntry",
    "OtherVersion",
    "KeyMismatch", "RecordKeys", "encode_header", "header_len", "open_payload", "parse_header",
    "payload_checksum", "seal_for", "seal_record", "verify_payload", "expected_header_len",
    "token_digest", "MIN_KEY_BYTES", "load_record_keys",
    # the layout's other public names (kvtier.backends.record_layout)
    "DIGEST", "MAC", "AUTHENTICATED", "ENCRYPTED", "MAX_KEY_LEN", "MAX_TOKENS", "Stored",
]


def _prefix(key: ChunkKey, obj: Stored, segment_bytes: int, flags: int,
            checksum: int) -> tuple[bytes, bytes]:
    """The fixed prefix (without the header checksum) and the key string + token digest of a
    record holding `obj` under `key`, after checking that they can form one."""
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
    hlen = expected_header_len(key)
    dtype = dtype_name(obj.tensor.dtype).encode()
    if isinstance(obj, Encoded):
        flags |= obj.codec.id << _CODEC_SHIFT
    prefix = _FIXED.pack(MAGIC, VERSION, hlen, int(obj.fmt), dtype, *shape, obj.nbytes,
                         segment_bytes, key.num_tokens, len(key_bytes), flags, checksum,
                         0)[:_CHECKED]
    return prefix, key_bytes + token_digest(key)


def seal_for(key: ChunkKey, obj: Stored, *, segment_bytes: int = 0,
             keys: RecordKeys | None = None) -> Seal:
    """A `Seal` for the record of `obj` (an arena object, or a codec's `Encoded` payload of
    one) under `key` (encrypting under `keys.current` when
    `keys` is given, with the key of `key.salt`'s tenant), for I/O code to feed the payload
    through piece by piece before `encode_header(..., seal=)`.

    Raises:
        ValueError: naming `key`, `obj` or `segment_bytes` when they cannot form a record.
    """
    prefix, body = _prefix(key, obj, segment_bytes, _SEALED if keys else 0, 0)
    return Seal(keys, _aad(prefix, body), key.salt)


def encode_header(key: ChunkKey, obj: Stored, *, segment_bytes: int = 0,
                  seal: Seal | None = None) -> bytes:
    """The header of a record holding `obj` under `key`.

    Args:
        key: the chunk key; its token count must equal `obj.num_tokens`.
        obj: the payload (read, never modified).
        segment_bytes: 0, or the segment size the payload is stored in (Redis).
        seal: the payload's `Seal` from `seal_for` (same key, obj and segment_bytes), fed the
            whole payload; None: a plain record, checksummed from `obj.byte_view()`.

    Raises:
        ValueError: naming `key`, `obj`, `segment_bytes` or `seal` when they cannot form a
            record (a seal made for another record included).
    """
    if seal is None:
        seal = seal_for(key, obj, segment_bytes=segment_bytes)
        seal.update(obj.byte_view())
    flags = _SEALED if seal.encrypted else 0
    prefix, body = _prefix(key, obj, segment_bytes, flags, seal.checksum)
    if seal.aad != _aad(prefix, body):
        raise ValueError("seal: made for another record (key, obj or segment_bytes differ)")
    field = seal.field() or bytes(MAC)
    hsum = xxhash.xxh3_64_intdigest(prefix + body + field)
    return prefix + struct.pack("<Q", hsum) + body + field


def seal_record(key: ChunkKey, obj: Stored, seal: Seal, out: memoryview | None = None, *,
                segment_bytes: int = 0) -> tuple[bytes, memoryview]:
    """Feed `obj`'s payload through `seal` (from `seal_for` with the same arguments) and return
    the record's header and stored payload: the arena's own bytes for a plain record, `out`
    (`obj.nbytes` bytes, the caller's) holding the ciphertext for an encrypted one.

    Raises ValueError naming `out` or `seal` as `Seal.update` and `encode_header` do."""
    view = obj.byte_view()
    if seal.encrypted:
        if out is None:
            raise ValueError("out: an encrypted record needs a buffer for its ciphertext")
        stored = memoryview(seal.update(view, out))
    else:
        stored = memoryview(seal.update(view))
    return encode_header(key, obj, segment_bytes=segment_bytes, seal=seal), stored


class OtherVersion(CorruptEntry):
    """A record in a format this reader does not know: another format `VERSION`, or flag bits
    it has no meaning for (a newer kvtier's, usually). A miss, counted, and never deleted:
    servers of two kvtier versions share a tier during a rolling upgrade, and neither may
    wipe what the other stores."""


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
        raise OtherVersion(f"version: {version} != {VERSION} (another kvtier's format)")
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
    codec, flags = _codec(flags >> _CODEC_SHIFT), flags & ((1 << _CODEC_SHIFT) - 1)
    if payload_len != codec.payload_nbytes(layout, n):
        raise CorruptEntry(f"payload_len: {payload_len} != {codec.payload_nbytes(layout, n)} "
                           f"({codec.name})")
    if flags not in _FLAGS:
        raise OtherVersion(f"flags: {flags:#x} has bits this version does not know")
    seal = head[digest_end:digest_end + MAC] if flags else b""
    return RecordHeader(hlen, MemoryFormat(fmt), dtype, shape, payload_len, segment_bytes,
                        checksum, key.key, flags, seal, _aad(head, head[FIXED_SIZE:digest_end]),
                        key.salt, codec)


def _codec(codec_id: int) -> Codec:
    codec = codec_by_id(codec_id)
    if codec is None:
        raise OtherVersion(f"codec: id {codec_id} is unknown to this kvtier version (another "
                           "kvtier's codec); not loaded")
    return codec


def open_payload(header: RecordHeader, keys: RecordKeys | None) -> Unseal:
    """The `Unseal` that reads the payload of the record `header` describes with `keys` (the
    reader's record keys, or None), for I/O code to feed the stored pieces through.

    Raises (before any payload byte is read):
        KeyMismatch: the reader may not load this record: it holds keys and the record is not
            encrypted (plain, or an older kvtier's HMAC record), or it holds none (or not the
            record's) and the record is sealed.
    """
    if header.flags == AUTHENTICATED:  # an older kvtier's HMAC: the payload is in clear
        raise KeyMismatch("seal: the record is authenticated with an HMAC by an older kvtier, "
                          "not encrypted; it is loaded by no reader of this version")
    return Unseal(keys, header.seal if header.flags else None, header.aad, header.salt)


def verify_payload(header: RecordHeader, view: memoryview | bytes, *,
                   unseal: Unseal | None = None, keys: RecordKeys | None = None) -> None:
    """Raise unless `view` is exactly and genuinely the payload `header` describes; on return,
    an encrypted payload has been decrypted where it lies (`view` must then be writable).

    `unseal`: the payload's `Unseal` (from `open_payload`) when the caller fed the stored
    bytes through it already; else one is made with `keys` and fed `view`.

    Raises:
        CorruptEntry: a length or checksum mismatch.
        ForgedEntry: the record may not be loaded with `keys` (`open_payload`), or fails its
            GCM tag; what was decrypted into `view` must then be discarded.
    """
    if len(view) != header.payload_len:
        raise CorruptEntry(f"payload_len: got {len(view)} bytes, expected {header.payload_len}")
    if unseal is None:
        unseal = open_payload(header, keys)
        view = memoryview(view)
        # A payload already in memory: each piece is copied to the scratch and decrypted back
        # (never in place; I/O code avoids the copy by reading into `landing` itself).
        for at in range(0, len(view), _PIECE):
            piece = view[at : at + _PIECE]
            stored = unseal.landing(piece)
            if stored is not piece:
                stored[:] = piece
            unseal.update(stored, piece)
    unseal.finish(header.checksum)
