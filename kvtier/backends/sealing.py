"""Record keys, and the sealing of record payloads on shared tiers: AES-256-GCM encryption.

A record's payload is the KV itself, and layer 0's V rows are a per-token function of the token
(no position in V): whoever reads a record and has the model's weights can match its rows
against the vocabulary and read the prompt back. So with a record key (`record_key_file`) every
record on disk and in Redis is encrypted and authenticated with AES-256-GCM, the record's
header fields as associated data; without one, records are plain (checksummed only).

Keys. `record_key_file` holds one secret per line, the current one first, then previous ones
still accepted (rotation). From each secret: a master key, HKDF-SHA256 with a fixed info
string, and a key id, the first 4 bytes of SHA-256 over a fixed prefix and the master key
(stored in every record, so a reader picks the right key, or knows it holds none). Each
record is encrypted under its own key, HKDF-Expand of the master key with the record's random
96-bit nonce and header: random nonces would otherwise cap one master key at 2^32 records
(NIST SP 800-38D), which a fleet can write in weeks; now two records share a GCM key and nonce
only when they are the same chunk's record and drew the same nonce. A salted chunk (a
tenant's) derives its record key from its tenant's master key instead (kvtier.keys.tenant_keys).

Sealing runs piece by piece, as I/O code walks the payload: a writer encrypts each piece into a
buffer of its own (never the arena, whose object stays the plaintext the engine reads), a
reader reads each piece into a scratch buffer of one piece and decrypts it from there into the
arena right after reading it, so the payload crosses memory once, as a plain record's does
(GCM is not run in place: cryptography 51 refuses overlapping buffers). The payload checksum
(xxh3) covers the stored bytes, ciphertext included: a torn or corrupt record is a
`CorruptEntry` (deleted), while a record that is whole but fails GCM's tag is a `ForgedEntry`
(kept: it may be another key's).

The AEAD is `cryptography`'s (OpenSSL's AES-GCM); none of it is written here, on purpose.
The keys and their file are kvtier.keys.record_keys (re-exported here); this module holds
the sealing and opening of payloads and the errors a reader raises.
"""

from __future__ import annotations

import os

import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvtier.errors import CorruptEntry
from kvtier.keys.record_keys import (
    KEY_ID,
    MIN_KEY_BYTES,
    RecordKeys,
    load_record_keys,
    name_salt,
)

__all__ = ["ForgedEntry", "KeyMismatch", "RecordKeys", "Seal", "Unseal", "load_record_keys",
           "name_salt",
           "MIN_KEY_BYTES", "KEY_ID", "NONCE", "TAG", "FIELD"]

NONCE = 12  # GCM's native 96-bit nonce
TAG = 16
FIELD = KEY_ID + NONCE + TAG  # what an encrypted record keeps in the header's 32-byte MAC field


class ForgedEntry(CorruptEntry):
    """A record this reader must not load over its key, not over its bytes: sealed under a key
    this reader lacks (none, or another), not sealed while this reader holds a key, or failing
    its GCM tag (made or changed without the key). A miss, counted, and never deleted: a reader
    with a stale or mistyped key must not erase a cache its fleet shares, and nobody loads
    what they cannot verify."""


class KeyMismatch(ForgedEntry):
    """A `ForgedEntry` told by the header alone (raised before any payload byte is read): the
    record is sealed otherwise than this reader's keys can open. Re-reading cannot change it."""


class Seal:
    """A payload's stored form, made piece by piece while I/O code writes it: the checksum of
    the stored bytes and, with `keys`, the encryption of each piece under `keys.current`
    (AES-256-GCM, `aad` and the key id authenticated with it).

    `update()` with the payload's pieces in order, then `field()` once for the header.
    `salt`: the record's tenant, whose key encrypts it (kvtier.keys.tenant_keys).
    """

    def __init__(self, keys: RecordKeys | None = None, aad: bytes = b"", salt: str = ""):
        self.aad = aad
        self._sum = xxhash.xxh3_64()
        self._field = b""
        if keys is None:
            self._enc = None
            return
        key, nonce = keys.current, os.urandom(NONCE)
        self._head = key.key_id + nonce
        self._enc = Cipher(algorithms.AES(key.record_key(nonce, aad, salt)),
                           modes.GCM(nonce)).encryptor()
        self._enc.authenticate_additional_data(aad + key.key_id)

    @property
    def encrypted(self) -> bool:
        return self._enc is not None

    def update(self, piece: memoryview | bytes,
               out: memoryview | bytearray | None = None) -> memoryview | bytes:
        """Seal the payload's next `piece` and return its stored bytes: `piece` itself when
        the record is not encrypted, else its ciphertext, written into `out` (exactly
        `len(piece)` bytes, not overlapping `piece`).

        Raises ValueError naming `out` when an encrypting seal gets none, or one of another size.
        """
        if self._enc is None:
            stored: memoryview | bytes = piece
        else:
            if out is None or len(out) != len(piece):
                raise ValueError(f"out: an encrypting seal needs {len(piece)} bytes to write "
                                 f"the ciphertext into, got {None if out is None else len(out)}")
            stored = memoryview(out)[: self._enc.update_into(piece, out)]
        self._sum.update(stored)
        return stored

    @property
    def checksum(self) -> int:
        """The checksum of the bytes stored so far."""
        return int(self._sum.intdigest())

    def field(self) -> bytes:
        """The header's seal field once the whole payload went through `update()`: key id,
        nonce and GCM tag (`FIELD` bytes); b"" when the record is not encrypted."""
        if self._enc is not None and not self._field:
            self._enc.finalize()
            self._field = self._head + self._enc.tag
        return self._field


class Unseal:
    """The reading side of `Seal`: checks that `keys` may open a record whose header holds
    seal field `field` (None: a plain record) and, piece by piece, checksums the stored bytes
    and decrypts them into the payload's memory: I/O code reads each piece into
    `landing(piece)`, then calls `update(stored, piece)`. `salt`: the tenant the record is
    read for (one written for another fails its tag in `finish`).

    Raises (from the constructor, before any payload is read):
        KeyMismatch: a plain record and a reader with keys; a sealed record and a reader
            without keys, or without the key the record names.
    """

    def __init__(self, keys: RecordKeys | None, field: bytes | None, aad: bytes,
                 salt: str = ""):
        self._sum = xxhash.xxh3_64()
        self._scratch = memoryview(bytearray(0))
        if field is None:
            if keys is not None:
                raise KeyMismatch("seal: the record is not encrypted (written without a "
                                  "record key); this reader loads encrypted records only")
            self._dec = None
            return
        if len(field) != FIELD:
            raise CorruptEntry(f"seal: field of {len(field)} bytes, expected {FIELD}")
        if keys is None:
            raise KeyMismatch("seal: the record is encrypted with a record key this reader "
                              "does not hold (set the same record_key_file on every instance)")
        key_id, nonce, tag = field[:KEY_ID], field[KEY_ID:KEY_ID + NONCE], field[-TAG:]
        key = keys.get(key_id)
        if key is None:
            raise KeyMismatch(f"seal: key id {key_id.hex()} is none of this reader's record "
                              f"keys ({', '.join(keys.ids)}): written under another key")
        self._dec = Cipher(algorithms.AES(key.record_key(nonce, aad, salt)),
                           modes.GCM(nonce, tag)).decryptor()
        self._dec.authenticate_additional_data(aad + key_id)

    @property
    def encrypted(self) -> bool:
        return self._dec is not None

    def landing(self, piece: memoryview) -> memoryview:
        """Where I/O code reads the stored bytes of the payload's next `piece`: `piece` itself
        for a plain record, else a scratch buffer of `len(piece)` bytes, reused from piece to
        piece, that `update()` decrypts into `piece`. The stored bytes cross memory once
        either way: GCM may not decrypt in place (cryptography >= 51 refuses overlapping
        buffers), and a scratch of one piece stays in the CPU cache between read and decrypt.
        """
        if self._dec is None:
            return piece
        if len(self._scratch) < len(piece):
            self._scratch = memoryview(bytearray(len(piece)))
        return self._scratch[: len(piece)]

    def update(self, stored: memoryview | bytes, piece: memoryview | None = None) -> None:
        """The payload's next `stored` bytes, read into `landing(piece)`: checksummed and,
        when encrypted, decrypted into `piece` (writable, `len(stored)` bytes, not overlapping
        `stored`).

        Raises ValueError naming `piece` when an encrypted record's piece is missing or of
        another size than `stored`.
        """
        self._sum.update(stored)
        if self._dec is None:
            return
        if piece is None or len(piece) != len(stored):
            raise ValueError(f"piece: decrypting {len(stored)} stored bytes needs a piece of as "
                             f"many, got {None if piece is None else len(piece)}")
        self._dec.update_into(stored, piece)

    def finish(self, checksum: int) -> None:
        """Raise unless the payload read is whole and genuine.

        Raises:
            CorruptEntry: the stored bytes do not match `checksum` (the header's).
            ForgedEntry: they do, but fail GCM's tag: made or changed without the key, or a
                header field changed (the caller must discard what was decrypted).
        """
        if self._sum.intdigest() != checksum:
            raise CorruptEntry("payload checksum mismatch")
        if self._dec is not None:
            try:
                self._dec.finalize()
            except InvalidTag:
                raise ForgedEntry("seal: the GCM tag does not verify (the record or its header "
                                  "was made or changed without the record key, or for "
                                  "another tenant)") from None
