"""Encrypted records, in memory: AES-256-GCM round trips streamed in any pieces, which reader
may open which record (told by the header, before any payload is read), tampering with the
ciphertext, the tag or a header field, key rotation, and the record key file."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.backends import record, sealing
from kvtier.backends.record import (
    FIXED_SIZE,
    RecordHeader,
    RecordKeys,
    encode_header,
    header_len,
    open_payload,
    parse_header,
    seal_for,
    verify_payload,
)
from kvtier.errors import ConfigError, CorruptEntry
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, lease
from tests.backends.keyed import refresh_checksums
from tests.helpers import SMALL_MHA, make_keys, make_obj

SECRET = b"a shared secret, 32 bytes long.."
OLD = b"last month's secret, 32 bytes..."
KEYS = RecordKeys([SECRET])
_ALLOC = MemoryAllocator(1 << 20)
_FLAGS_AT = FIXED_SIZE - 17  # the flags byte, before the two checksums


def _sealed(key: ChunkKey, keys: RecordKeys | None, seed: int = 0, step: int = 7,
            ) -> tuple[bytes, bytes]:
    """A whole record of random payload under `key`, sealed in `step`-byte pieces; and its
    plaintext payload."""
    with lease([make_obj(_ALLOC, SMALL_MHA, key.num_tokens, seed)]) as (obj,):
        view, stored = obj.byte_view(), bytearray()
        seal = seal_for(key, obj, keys=keys)
        out = memoryview(bytearray(step))
        for start in range(0, len(view), step):
            piece = view[start : start + step]
            stored += seal.update(piece, out[: len(piece)] if keys else None)
        return encode_header(key, obj, seal=seal) + bytes(stored), bytes(view)


def _open(buf: bytes | bytearray, key: ChunkKey, keys: RecordKeys | None,
          step: int = 5) -> bytes:
    """Read a whole record as the tiers do: header, then the payload in `step`-byte pieces,
    each read into `landing(piece)` and decrypted into the payload; the plaintext, or the
    exception."""
    head = parse_header(buf, key, SMALL_MHA)
    unseal = open_payload(head, keys)
    stored = buf[head.header_len :]
    payload = memoryview(bytearray(len(stored)))
    for start in range(0, len(payload), step):
        piece = payload[start : start + step]
        landing = unseal.landing(piece)
        landing[:] = stored[start : start + len(piece)]  # the tier's read
        unseal.update(landing, piece)
    verify_payload(head, payload, unseal=unseal)
    return bytes(payload)


def _head(buf: bytes | bytearray, key: ChunkKey) -> RecordHeader:
    return parse_header(buf, key, SMALL_MHA)


def test_an_encrypted_record_round_trips_in_any_pieces() -> None:
    key = make_keys(16)[0]
    buf, plain = _sealed(key, KEYS, step=7)
    head = _head(buf, key)
    assert head.flags == record.AUTHENTICATED | record.ENCRYPTED
    assert head.seal[: sealing.KEY_ID] == KEYS.current.key_id and len(head.seal) == 32
    assert plain not in buf and plain[:16] not in buf  # ciphertext, not the payload
    assert head.checksum == record.payload_checksum(buf[head.header_len :])  # of what is stored
    for step in (1, 5, 16, 4096):  # pieces need not match the writer's
        assert _open(buf, key, KEYS, step) == plain
    again, _ = _sealed(key, KEYS)
    assert _head(again, key).seal[4:16] != head.seal[4:16]  # a fresh nonce per record
    assert again[head.header_len :] != buf[head.header_len :]


def test_who_may_open_what_is_told_before_the_payload() -> None:
    key = make_keys(16)[0]
    encrypted, _ = _sealed(key, KEYS)
    plain, _ = _sealed(key, None)
    other = RecordKeys([b"another secret of enough length!"])
    with pytest.raises(record.KeyMismatch, match="does not hold"):
        open_payload(_head(encrypted, key), None)  # no key: never loaded unverified
    with pytest.raises(record.KeyMismatch, match="not encrypted"):
        open_payload(_head(plain, key), KEYS)  # holding keys: loads encrypted records only
    with pytest.raises(record.KeyMismatch, match="key id .* none of this reader's") as err:
        open_payload(_head(encrypted, key), other)
    assert KEYS.current.key_id.hex() in str(err.value) and SECRET.decode() not in str(err.value)
    # What an older kvtier wrote with a key: an HMAC in the field, the payload in clear.
    legacy = bytearray(plain)
    legacy[_FLAGS_AT] = record.AUTHENTICATED
    legacy[header_len(plain) - 32 : header_len(plain)] = b"\x5a" * 32
    for keys in (None, KEYS):
        with pytest.raises(record.KeyMismatch, match="older kvtier"):
            open_payload(_head(refresh_checksums(legacy), key), keys)
    assert _open(plain, key, None) == _sealed(key, None)[1]


def test_rotation_opens_the_previous_keys_records_and_seals_with_the_current() -> None:
    key = make_keys(16)[0]
    old_record, plain = _sealed(key, RecordKeys([OLD]))
    rotated = RecordKeys([SECRET, OLD])
    assert _open(old_record, key, rotated) == plain
    new_record, plain = _sealed(key, rotated, seed=1)
    assert _head(new_record, key).seal[:4] == rotated.current.key_id == KEYS.current.key_id
    assert _open(new_record, key, KEYS) == plain  # the previous key retired: still opens
    with pytest.raises(record.KeyMismatch):
        _open(new_record, key, RecordKeys([OLD]))
    with pytest.raises(ValueError, match="keys 1 and 2 have the same key id"):
        RecordKeys([SECRET, SECRET])
    assert SECRET.decode() not in repr(rotated) and "_master" not in repr(rotated.current)


@pytest.mark.parametrize("where", ["ciphertext", "tag", "nonce", "segment_bytes", "num_tokens"])
def test_tampering_with_checksums_fixed_is_forged(where: str) -> None:
    """A neighbour who can write the tier and recomputes both checksums: the GCM tag (over the
    payload and the header fields) refuses it; with checksums left as they are, a change is a
    plain `CorruptEntry` (an accident, deleted by the tiers)."""
    key = make_keys(16)[0]
    buf, _ = _sealed(key, KEYS)
    hlen = header_len(buf)
    tampered = bytearray(buf)
    if where == "ciphertext":
        tampered[hlen + 100] ^= 0x01
    elif where == "tag":
        tampered[hlen - 1] ^= 0x80
    elif where == "nonce":
        tampered[hlen - 20] ^= 0x01
    elif where == "segment_bytes":  # a header field no other check ties to the key or layout
        struct.pack_into("<I", tampered, 43, 4096)
    else:  # a header field the parser checks: caught before the tag
        struct.pack_into("<I", tampered, 47, 17)
    with pytest.raises(CorruptEntry) as raw:
        _open(tampered, key, KEYS)
    assert not isinstance(raw.value, record.ForgedEntry)  # checksums not fixed: corrupt
    with pytest.raises(CorruptEntry) as fixed:
        _open(refresh_checksums(tampered), key, KEYS)
    if where == "num_tokens":
        assert "num_tokens" in str(fixed.value)
    else:
        assert isinstance(fixed.value, record.ForgedEntry), fixed.value
        assert "tag" in str(fixed.value)


def test_a_record_key_file_holds_keys_one_per_line(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    keys = sealing.load_record_keys(str(path))
    assert keys is not None and keys.ids == KEYS.ids
    assert sealing.load_record_keys(None) is None
    path.write_bytes(b"\n  " + SECRET + b"  \r\n\n" + OLD + b"\n")  # current, then previous
    keys = sealing.load_record_keys(str(path))
    assert keys is not None and keys.ids == RecordKeys([SECRET, OLD]).ids
    path.chmod(0o400)
    assert sealing.load_record_keys(str(path)) is not None
    path.chmod(0o600)
    for data, match in ((b"tiny", r"'.*key' holds 4 bytes.*at least 16"), (b"", "holds 0 bytes"),
                        (SECRET + b"\nshort\n", "line 2 of .* holds 5 bytes"),
                        (SECRET + b"\n" + SECRET, "keys 1 and 2 have the same key id")):
        path.write_bytes(data)
        with pytest.raises(ConfigError, match=f"record_key_file: .*{match}") as err:
            sealing.load_record_keys(str(path))
        assert SECRET.decode() not in str(err.value) and "short" not in str(err.value)
    with pytest.raises(ConfigError, match="record_key_file.*cannot read"):
        sealing.load_record_keys(str(tmp_path / "missing"))
    path.write_bytes(SECRET)
    for mode in (0o640, 0o604, 0o620):  # others may read it (forge) or write it (swap it)
        path.chmod(mode)
        with pytest.raises(ConfigError, match=f"record_key_file.*mode {mode:03o}.*chmod 600"):
            sealing.load_record_keys(str(path))


def test_an_encrypting_seal_needs_an_output_of_the_pieces_size() -> None:
    key = make_keys(16)[0]
    with lease([make_obj(_ALLOC, SMALL_MHA, 16, 0)]) as (obj,):
        seal = seal_for(key, obj, keys=KEYS)
        with pytest.raises(ValueError, match="out: .* needs 8 bytes"):
            seal.update(obj.byte_view()[:8])
        with pytest.raises(ValueError, match="out"):
            seal.update(obj.byte_view()[:8], bytearray(7))


def test_a_decrypting_unseal_lands_pieces_outside_the_payload() -> None:
    """GCM never runs in place (cryptography 51 refuses overlapping buffers): an encrypted
    record's pieces land in a scratch buffer apart from the payload, a plain record's in the
    payload itself, and a piece of another size than the stored bytes is refused by name."""
    key = make_keys(16)[0]
    buf, plain = _sealed(key, KEYS)
    head = _head(buf, key)
    payload = memoryview(bytearray(head.payload_len))
    unseal = open_payload(head, KEYS)
    landing = unseal.landing(payload[:64])
    assert len(landing) == 64 and landing.obj is not payload.obj
    with pytest.raises(ValueError, match="piece: .* needs a piece of as many, got 63"):
        unseal.update(landing, payload[:63])
    plain_buf, _ = _sealed(key, None)
    plain_head = _head(plain_buf, key)
    assert open_payload(plain_head, None).landing(payload[:64]) is not landing
    piece = payload[:64]
    assert open_payload(plain_head, None).landing(piece) is piece
    assert _open(buf, key, KEYS, step=1 << 20) == plain


def test_a_payload_in_memory_is_verified_and_decrypted_where_it_lies() -> None:
    key = make_keys(16)[0]
    buf, plain = _sealed(key, KEYS)
    head = _head(buf, key)
    payload = bytearray(buf[head.header_len :])
    verify_payload(head, memoryview(payload), keys=KEYS)
    assert bytes(payload) == plain


_MUTATION = st.tuples(st.sampled_from(["flip", "truncate"]), st.integers(0, 1 << 16),
                      st.integers(0, 7), st.booleans())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 999), mutations=st.lists(_MUTATION, min_size=1, max_size=3))
def test_fuzz_mutated_encrypted_records_never_open(seed: int,
                                                   mutations: list[tuple[str, int, int, bool]],
                                                   ) -> None:
    """Any change to an encrypted record, checksums recomputed or not, is refused."""
    key = make_keys(32, seed=seed)[seed % 2]
    original, plain = _sealed(key, KEYS, seed=seed)
    buf = bytearray(original)
    for op, pos, bit, refresh in mutations:
        if not buf:
            break
        pos %= len(buf)
        if op == "flip":
            buf[pos] ^= 1 << bit
        else:
            del buf[pos:]
        if refresh and len(buf) >= FIXED_SIZE:
            try:
                refresh_checksums(buf)
            except CorruptEntry:
                pass  # no longer a plausible header
    if bytes(buf) == original:
        assert _open(buf, key, KEYS) == plain
    else:
        with pytest.raises(CorruptEntry):
            _open(buf, key, KEYS)
