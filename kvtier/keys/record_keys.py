"""Record keys: the keys that seal records on shared tiers, and the key file that holds them.

`RecordKeys` (one store's keys, the current one first) and `_Key` (one key's id, master key and
per-record key derivation, as kvtier.backends.sealing's module doc describes under "Keys."),
and `load_record_keys` / `name_salt`: reading `record_key_file` with its checks (length, mode,
owner, a guessable key refused). Sealing and opening a payload with these keys is
kvtier.backends.sealing, which re-exports every public name here.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import stat
import zlib
from collections.abc import Sequence

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from kvtier.errors import ConfigError
from kvtier.keys.tenant_keys import tenant_master

__all__ = ["RecordKeys", "load_record_keys", "name_salt", "MIN_KEY_BYTES",
           "MIN_KEY_ENTROPY_BITS", "KEY_ID"]


MIN_KEY_BYTES = 16  # a record key shorter than this is refused
KEY_ID = 4
# Fixed HKDF info strings: a new derivation gets a new string, never a changed meaning.
_MASTER_INFO = b"kvtier record encryption v1: AES-256-GCM master key"
_RECORD_INFO = b"kvtier record encryption v1: record key\0"
_ID_PREFIX = b"kvtier record encryption v1: key id\0"
_NAMES_INFO = b"kvtier key names v1: the secret salting record names"


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
        """The AES-256 key of the record with `nonce` and header `aad` (see
        kvtier.backends.sealing's module doc), of tenant `salt` (kvtier.keys.tenant_keys)."""
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
