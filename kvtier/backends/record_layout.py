"""The record's layout: the fixed prefix's struct and offsets, the flags bits, the bounds a
reader checks lengths against, `RecordHeader` (a parsed, validated header) and the digests and
checksums a header holds (`token_digest`, `payload_checksum`, `_aad`: what GCM authenticates).

The format itself (field order, what each flag means, why) is kvtier.backends.record's module
doc; that module writes and reads records with these definitions and re-exports the public ones.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

import xxhash

from kvtier.backends.codec import NAIVE, Codec, Encoded
from kvtier.backends.sealing import FIELD
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryFormat, MemoryObj

__all__ = [
    "MAGIC", "VERSION", "FIXED_SIZE", "DIGEST", "MAC", "AUTHENTICATED", "ENCRYPTED",
    "MAX_KEY_LEN", "MAX_TOKENS", "RecordHeader", "Stored", "payload_checksum", "token_digest",
    "expected_header_len",
]


MAGIC = b"KVTR"
VERSION = 2  # unchanged by encryption: see the module docstring
_FIXED = struct.Struct("<4sHIB8s4IQIIHBQQ")
FIXED_SIZE: int = _FIXED.size
_CHECKED = FIXED_SIZE - 8  # the header checksum is the fixed prefix's last 8 bytes
_SUM_AT = _CHECKED - 8  # the payload checksum: known after the payload, so not in the AAD
DIGEST = 32
MAC = FIELD  # the seal field (named for the HMAC it held before encryption)
AUTHENTICATED = 1  # flags bit: the seal field is not zeros (see the module docstring)
ENCRYPTED = 2  # flags bit: AES-256-GCM ciphertext; the seal field: key id, nonce, tag
_SEALED = AUTHENTICATED | ENCRYPTED
_FLAGS = {0, AUTHENTICATED, _SEALED}
_CODEC_SHIFT = 4  # the flags byte's high bits: the payload's codec id
# Plausibility bounds: they keep a corrupt length field from making a reader allocate or read
# absurd amounts before the checksum has been verified.
MAX_KEY_LEN = 4096
_PIECE = 1 << 20  # what `verify_payload` decrypts at a time
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
    checksum: int  # of the payload as stored
    key: str
    flags: int
    seal: bytes  # the seal field when flags has ENCRYPTED or AUTHENTICATED, else b""
    aad: bytes  # the header bytes GCM authenticates (see `_aad`)
    salt: str = ""  # the tenant it is read for (the requested key's): picks the record key
    codec: Codec = NAIVE  # what the payload holds (`decode` it unless naive)


def payload_checksum(view: memoryview | bytes) -> int:
    """The checksum of a payload (xxh3_64: fast enough never to cap disk or network speed)."""
    return xxhash.xxh3_64_intdigest(view)


def token_digest(key: ChunkKey) -> bytes:
    """What a record stores to verify `key.tokens` (never the tokens themselves)."""
    return hashlib.sha256(key.key.encode() + b"\0" + key.tokens).digest()


def expected_header_len(key: ChunkKey) -> int:
    """The exact header length of a record stored under `key`."""
    return FIXED_SIZE + len(key.key.encode()) + DIGEST + MAC


def _aad(prefix: bytes, body: bytes) -> bytes:
    """GCM's associated data: the fixed prefix up to the header checksum with the payload
    checksum zeroed (it is known only once the payload is sealed), then the key string and the
    token digest (`body`). The key id is appended by the seal."""
    return prefix[:_SUM_AT] + bytes(8) + body


Stored = MemoryObj | Encoded  # what a record holds: the arena's bytes or a codec's payload
