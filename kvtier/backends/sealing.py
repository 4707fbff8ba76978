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
tenant's) derives its record key from its tenant's master key instead (tenant_keys.py).

Sealing runs piece by piece, as I/O code walks the payload: a writer encrypts each piece into a
buffer of its own (never the arena, whose object stays the plaintext the engine reads), a
reader reads each piece into a scratch buffer of one piece and decrypts it from there into the
arena right after reading it, so the payload crosses memory once, as a plain record's does
(GCM is not run in place: cryptography 51 refuses overlapping buffers). The payload checksum
(xxh3) covers the stored bytes, ciphertext included: a torn or corrupt record is a
`CorruptEntry` (deleted), while a record that is whole but fails GCM's tag is a `ForgedEntry`
(kept: it may be another key's).

The AEAD is `cryptography`'s (OpenSSL's AES-GCM); none of it is written here, on purpose.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import stat
import zlib
from collections.abc import Sequence

import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from kvtier.backends.tenant_keys import tenant_master
from kvtier.errors import ConfigError, CorruptEntry

__all__ = ["ForgedEntry", "KeyMismatch", "RecordKeys", "Seal", "Unseal", "load_record_keys",
           "name_salt",
           "MIN_KEY_BYTES", "KEY_ID", "NONCE", "TAG", "FIELD"]

MIN_KEY_BYTES = 16  # a record key shorter than this is refused
KEY_ID = 4
NONCE = 12  # GCM's native 96-bit nonce
TAG = 16
FIELD = KEY_ID + NONCE + TAG  # what an encrypted record keeps in the header's 32-byte MAC field
# Fixed HKDF info strings: a new derivation gets a new string, never a changed meaning.
_MASTER_INFO = b"kvtier record encryption v1: AES-256-GCM master key"
_RECORD_INFO = b"kvtier record encryption v1: record key\0"
_ID_PREFIX = b"kvtier record encryption v1: key id\0"
_NAMES_INFO = b"kvtier key names v1: the secret salting record names"


class ForgedEntry(CorruptEntry):
    """A record this reader must not load over its key, not over its bytes: sealed under a key
    this reader lacks (none, or another), not sealed while this reader holds a key, or failing
    its GCM tag (made or changed without the key). A miss, counted, and never deleted: a reader
    with a stale or mistyped key must not erase a cache its fleet shares, and nobody loads
    what they cannot verify."""


class KeyMismatch(ForgedEntry):
    """A `ForgedEntry` told by the header alone (raised before any payload byte is read): the
    record is sealed otherwise than this reader's keys can open. Re-reading cannot change it."""


class _Key:
    """One record key: its id and master key (never shown by `repr`)."""

    __slots__ = ("key_id", "_master")

    def __init__(self, secret: bytes):
        self._master = HKDF(hashes.SHA256(), 32, salt=None, info=_MASTER_INFO).derive(secret)
        self.key_id = hashlib.sha256(_ID_PREFIX + self._master).digest()[:KEY_ID]

    def names_secret(self) -> str:
        """A secret for salting key names (its own HKDF label: it reveals nothing of the
        record keys)."""
        return HKDFExpand(hashes.SHA256(), 32, info=_NAMES_INFO).derive(self._master).hex()

    def record_key(self, nonce: bytes, aad: bytes, salt: str = "") -> bytes:
        """The AES-256 key of the record with `nonce` and header `aad` (see the module doc),
        of tenant `salt` (kvtier.backends.tenant_keys)."""
        info = _RECORD_INFO + nonce + aad
        return HKDFExpand(hashes.SHA256(), 32, info=info).derive(
            tenant_master(self._master, salt))

    def __repr__(self) -> str:
        return f"<record key id {self.key_id.hex()}>"


class RecordKeys:
    """The record keys of one store: `current` seals what this instance writes; a record sealed
    under any of them (found by its key id) is opened."""

    def __init__(self, secrets: Sequence[bytes]):
        """Raises ValueError naming `secrets` (never a key) when it is empty or two of its
        keys share a key id (the same key twice)."""
        if not secrets:
            raise ValueError("secrets: at least one record key is needed")
        keys = [_Key(s) for s in secrets]
        self._by_id: dict[bytes, _Key] = {}
        for i, key in enumerate(keys):
            if key.key_id in self._by_id:
                first = next(j for j, k in enumerate(keys) if k.key_id == key.key_id)
                raise ValueError(f"secrets: keys {first + 1} and {i + 1} have the same key id "
                                 f"(the same key twice?)")
            self._by_id[key.key_id] = key
        self.current = keys[0]
        # Key names are salted by the oldest key's secret: adding a new current key keeps
        # every name (records under both keys stay reachable); retiring the oldest starts a
        # new name space, when its records become unreadable anyway.
        self.names_secret = keys[-1].names_secret()

    def get(self, key_id: bytes) -> _Key | None:
        return self._by_id.get(bytes(key_id))

    @property
    def ids(self) -> list[str]:
        """The key ids, current first, in hex (safe to log)."""
        return [k.hex() for k in self._by_id]

    def __len__(self) -> int:
        return len(self._by_id)

    def __repr__(self) -> str:
        return f"RecordKeys(ids={self.ids})"


MIN_KEY_ENTROPY_BITS = 96  # by `_entropy_bits`: words, repeated phrases and patterns fail


def _entropy_bits(secret: bytes) -> tuple[float, int]:
    """An estimate of `secret`'s entropy and its number of distinct bytes.

    The Shannon entropy of its byte frequencies per byte, times the bytes left once repeats are
    taken out: raw DEFLATE with fixed Huffman codes, where a literal costs a byte (8 or 9 bits)
    and every repeat of 3 bytes or more a short back-reference, so the share of the secret
    DEFLATE cannot shorten is the share that is not repetition (at most 1). Frequencies alone
    count a phrase repeated k times k times over; this counts it about once. An upper bound
    for words and patterns; a random key loses nothing (32 random bytes as base64 or hex
    estimate at 190 bits or more, twice the minimum)."""
    counts = collections.Counter(secret)
    n = len(secret)
    per_byte = -sum(c * math.log2(c / n) for c in counts.values()) / n
    packer = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_FIXED)
    unrepeated = min(n, len(packer.compress(secret) + packer.flush()))
    return per_byte * unrepeated, len(counts)


def _trust_problem(path: str) -> str | None:
    """Why the key file at `path` may be changed by someone else, or None: it is another
    user's (root aside), or its directory is writable by others without the sticky bit (the
    file could be replaced) or belongs to another user."""
    me = os.geteuid()
    st = os.stat(path)
    if st.st_uid not in (me, 0):
        return f"belongs to uid {st.st_uid}, not to this user ({me}): its owner can change the key"
    parent = os.path.dirname(os.path.abspath(path))
    dst = os.stat(parent)
    if dst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not dst.st_mode & stat.S_ISVTX:
        return (f"is in {parent}, which other users may write (mode "
                f"{stat.S_IMODE(dst.st_mode):03o}): they could replace the key file; keep it "
                "in a directory only you can write")
    if dst.st_uid not in (me, 0):
        return f"is in {parent}, which belongs to uid {dst.st_uid}: they could replace it"
    return None


def name_salt(hash_salt: str, record_key_file: str | None) -> str:
    """The salt of key names: `hash_salt`, and with `record_key_file` a secret derived from
    its keys, so that a reader of a tier without the key cannot test a guessed prompt against
    the names (`ConfigError` as `load_record_keys`)."""
    keys = load_record_keys(record_key_file)
    return hash_salt if keys is None else f"{hash_salt}\0keyed:{keys.names_secret}"


def load_record_keys(path: str | None) -> RecordKeys | None:
    """The record keys in file `path`, one per line (surrounding whitespace dropped, blank
    lines skipped), the current key first; None without a path.

    Raises:
        ConfigError: naming `record_key_file` (never a key) when the path holds a NUL byte,
            the file cannot be read, holds no key or a key of fewer than `MIN_KEY_BYTES`
            bytes, holds one key twice, or is open to the group or others (a mode other than
            0600 or 0400), may be changed by another user (`_trust_problem`), or holds a
            guessable key (`_entropy_bits`).
    """
    if not path:
        return None
    if "\0" in path:  # open() would raise ValueError, not OSError
        raise ConfigError(f"record_key_file: {path!r} holds a NUL byte, which no file name "
                          "can: give the path of the key file")
    full = os.path.expanduser(path)
    try:
        with open(full, "rb") as f:
            data = f.read(1 << 16)
            mode = os.fstat(f.fileno()).st_mode
    except OSError as exc:
        raise ConfigError(f"record_key_file: cannot read {path!r}: "
                          f"{exc.strerror or exc}") from None
    secrets = [line.strip() for line in data.splitlines() if line.strip()]
    for i, secret in enumerate(secrets or [b""]):
        if len(secret) < MIN_KEY_BYTES:
            where = f"line {i + 1} of {path!r}" if len(secrets) > 1 else repr(path)
            raise ConfigError(f"record_key_file: {where} holds {len(secret)} bytes; a record "
                              f"key needs at least {MIN_KEY_BYTES} (e.g. `head -c 32 "
                              f"/dev/urandom | base64 > {path}`)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"record_key_file: {path!r} is open to other users (mode "
                          f"{stat.S_IMODE(mode):03o}); whoever reads it can read and forge "
                          f"records and whoever writes it can change the key: chmod 600 {path}")
    why = _trust_problem(full)
    if why is not None:
        raise ConfigError(f"record_key_file: {path!r} {why}")
    for i, secret in enumerate(secrets):
        bits, distinct = _entropy_bits(secret)
        if bits < MIN_KEY_ENTROPY_BITS or distinct < 8:
            where = f"line {i + 1} of {path!r}" if len(secrets) > 1 else repr(path)
            raise ConfigError(f"record_key_file: {where} looks guessable (about {bits:.0f} "
                              f"bits in {distinct} distinct bytes; at least "
                              f"{MIN_KEY_ENTROPY_BITS} wanted): with the key id in every "
                              f"record it can be found offline; use `head -c 32 /dev/urandom "
                              f"| base64 > {path}`")
    try:
        return RecordKeys(secrets)
    except ValueError as exc:
        raise ConfigError(f"record_key_file: {path!r}: {str(exc).removeprefix('secrets: ')}"
                          ) from None


class Seal:
    """A payload's stored form, made piece by piece while I/O code writes it: the checksum of
    the stored bytes and, with `keys`, the encryption of each piece under `keys.current`
    (AES-256-GCM, `aad` and the key id authenticated with it).

    `update()` with the payload's pieces in order, then `field()` once for the header.
    `salt`: the record's tenant, whose key encrypts it (kvtier.backends.tenant_keys).
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
