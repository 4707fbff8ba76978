"""The record format: round trips, field-by-field validation, and a parser fuzz.

The fuzz feeds well over 10^4 generated and mutated records through `read_into` (the tiers'
validate-then-copy path) and checks that the only outcomes are an exact payload or a
`CorruptEntry`, and that no byte outside the destination, or inside it on failure, changes.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.backends import record
from kvtier.backends.record import (
    FIXED_SIZE,
    RecordHeader,
    encode_header,
    header_len,
    parse_header,
    payload_checksum,
    verify_payload,
)
from kvtier.errors import CorruptEntry
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease
from tests.helpers import SMALL_MHA, SMALL_MLA, make_keys, make_obj

FP32_MHA = KVLayout.mha(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
LAYOUTS = [SMALL_MHA, SMALL_MLA, FP32_MHA]


def _fuzz(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


GUARD = 64
FILL = 0xA5

# One arena for the whole module: hypothesis examples must not allocate per example.
_ALLOC = MemoryAllocator(1 << 20)


def read_into(record: bytes, key: ChunkKey, layout: KVLayout, out: memoryview) -> RecordHeader:
    """Validate a whole record held in memory, then copy its payload into `out` (the order in
    which the disk and Redis tiers read: nothing reaches `out` unless everything validated)."""
    header = parse_header(record, key, layout)
    if len(record) != header.header_len + header.payload_len:
        raise CorruptEntry(f"record length {len(record)} != header + payload")
    payload = memoryview(record)[header.header_len:]
    verify_payload(header, payload)
    out[:] = payload
    return header


def _record(key: ChunkKey, obj: MemoryObj, **kw: int) -> bytes:
    return encode_header(key, obj, **kw) + bytes(obj.byte_view())


def _try_read(buf: bytes | bytearray, key: ChunkKey, layout: KVLayout) -> bytes | None:
    """`read_into` into a guarded buffer: the payload it wrote, or None on CorruptEntry.

    Fails the test on any other exception, on a write outside the destination, and on a write
    into the destination when the record was rejected.
    """
    n = layout.nbytes(key.num_tokens)
    area = bytearray([FILL]) * (n + 2 * GUARD)
    out = memoryview(area)[GUARD : GUARD + n]
    try:
        read_into(bytes(buf), key, layout, out)
    except CorruptEntry:
        assert area == bytearray([FILL]) * len(area), "rejected record wrote to the arena"
        return None
    assert area[:GUARD] == bytearray([FILL]) * GUARD, "write before the destination"
    assert area[GUARD + n :] == bytearray([FILL]) * GUARD, "write past the destination"
    return bytes(out)


def _key(layout: KVLayout, num_tokens: int, seed: int) -> ChunkKey:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2**32, num_tokens, dtype=np.uint64).astype("<u4").tobytes()
    digest = rng.integers(0, 256, 32, dtype=np.uint8).tobytes().hex()
    name = f"kvtier/v2/default/m/{layout.fingerprint(16)}/0of1/{digest}"
    return ChunkKey(name, 0, num_tokens, tokens, None)


def _filled(layout: KVLayout, num_tokens: int, seed: int) -> MemoryObj:
    obj = _ALLOC.allocate(layout, num_tokens)
    assert obj is not None
    view = obj.byte_view()
    view[:] = np.random.default_rng(seed).integers(0, 256, len(view), dtype=np.uint8).tobytes()
    return obj


# --- round trip and field checks -------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=["mha-bf16", "mla-fp16", "mha-fp32"])
def test_round_trip(layout: KVLayout) -> None:
    key = _key(layout, 5, seed=1)
    with lease([_filled(layout, 5, seed=2)]) as (obj,):
        buf = _record(key, obj, segment_bytes=4096)
        head = parse_header(buf, key, layout)
        assert head.header_len == header_len(buf[:FIXED_SIZE]) == len(buf) - obj.nbytes
        assert head.header_len == record.expected_header_len(key)
        assert head.fmt is layout.fmt and head.shape == layout.shape(5)
        assert head.payload_len == obj.nbytes and head.segment_bytes == 4096
        assert head.key == key.key and head.seal == b"" and head.flags == 0
        assert key.tokens not in buf[: head.header_len]  # verified by digest, never stored
        assert head.checksum == payload_checksum(obj.byte_view())
        verify_payload(head, memoryview(buf)[head.header_len :])
        assert _try_read(buf, key, layout) == bytes(obj.byte_view())


def test_a_precomputed_seal_gives_the_same_header() -> None:
    key = _key(SMALL_MHA, 3, seed=3)
    with lease([_filled(SMALL_MHA, 3, seed=4)]) as (obj,):
        seal = record.seal_for(key, obj)
        view = obj.byte_view()
        for start in range(0, len(view), 7):  # streamed in pieces
            assert seal.update(view[start : start + 7]) == view[start : start + 7]
        assert encode_header(key, obj) == encode_header(key, obj, seal=seal)
        assert seal.checksum == payload_checksum(view)
        with pytest.raises(ValueError, match="seal"):  # made for another record
            encode_header(key, obj, segment_bytes=4096, seal=seal)


def _mismatch_cases() -> list[tuple[str, ChunkKey, KVLayout]]:
    key = _key(SMALL_MHA, 4, seed=5)
    other_dtype = KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    other_shape = KVLayout.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    other_tokens = key._replace(tokens=bytes(len(key.tokens)))
    return [
        ("key", key._replace(key=key.key[:-1] + "x"), SMALL_MHA),
        ("tokens", other_tokens, SMALL_MHA),
        ("num_tokens", key._replace(end=5, tokens=key.tokens + b"\0" * 4), SMALL_MHA),
        ("fmt", key, KVLayout.mla(num_layers=2, kv_dim=16, dtype=torch.bfloat16)),
        ("dtype", key, other_dtype),
        ("shape", key, other_shape),
    ]


@pytest.mark.parametrize("case", _mismatch_cases(), ids=lambda c: c[0])
def test_every_field_is_checked(case: tuple[str, ChunkKey, KVLayout]) -> None:
    field, asked, layout = case
    key = _key(SMALL_MHA, 4, seed=5)
    with lease([_filled(SMALL_MHA, 4, seed=6)]) as (obj,):
        buf = _record(key, obj)
    with pytest.raises(CorruptEntry, match=field):
        parse_header(buf, asked, layout)
    assert _try_read(buf, asked, layout) is None


def test_corrupt_header_payload_and_lengths() -> None:
    key = _key(SMALL_MHA, 4, seed=7)
    with lease([_filled(SMALL_MHA, 4, seed=8)]) as (obj,):
        buf = bytearray(_record(key, obj))
    hlen = header_len(buf)
    flipped_key = bytearray(buf)
    flipped_key[FIXED_SIZE + 3] ^= 1
    with pytest.raises(CorruptEntry, match="header checksum"):
        parse_header(flipped_key, key, SMALL_MHA)
    flipped_payload = bytearray(buf)
    flipped_payload[-1] ^= 0x80
    head = parse_header(flipped_payload, key, SMALL_MHA)
    with pytest.raises(CorruptEntry, match="payload checksum"):
        verify_payload(head, memoryview(flipped_payload)[hlen:])
    with pytest.raises(CorruptEntry, match="magic"):
        header_len(b"XXXX" + bytes(buf[4:FIXED_SIZE]))
    with pytest.raises(CorruptEntry, match="version"):
        header_len(bytes(buf[:4]) + struct.pack("<H", 99) + bytes(buf[6:FIXED_SIZE]))
    with pytest.raises(CorruptEntry, match="short"):
        header_len(bytes(buf[: FIXED_SIZE - 1]))
    with pytest.raises(CorruptEntry, match="short"):
        parse_header(bytes(buf[: hlen - 1]), key, SMALL_MHA)
    for bad in (flipped_key, flipped_payload, buf[:-1], buf + b"\0", b""):
        assert _try_read(bad, key, SMALL_MHA) is None


def test_encode_rejects_a_key_that_does_not_match_the_object() -> None:
    keys = make_keys(32, layout=SMALL_MHA)
    obj = make_obj(_ALLOC, SMALL_MHA, 8, seed=0)
    with lease([obj]), pytest.raises(ValueError, match="obj"):
        encode_header(keys[0], obj)


# --- fuzz ---------------------------------------------------------------------------------------

_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 16), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 16), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 16), st.integers(1, 64)),
    st.tuples(st.just("u32"), st.integers(0, 1 << 16), st.integers(0, 2**32 - 1)),
)


def _mutate(buf: bytearray, op: str, pos: int, arg: int) -> None:
    if not buf and op != "insert":
        return
    pos %= len(buf) + (op == "insert")
    if op == "flip":
        buf[pos] ^= 1 << arg
    elif op == "set":
        buf[pos] = arg
    elif op == "truncate":
        del buf[pos:]
    elif op == "insert":
        buf[pos:pos] = bytes([arg])
    elif op == "delete":
        del buf[pos : pos + arg]
    else:  # overwrite a little-endian u32 (hits length fields)
        buf[pos : pos + 4] = struct.pack("<I", arg)


@_fuzz(4000)
@given(layout=st.sampled_from(LAYOUTS), num_tokens=st.integers(1, 24), seed=st.integers(0, 999),
       mutations=st.lists(_MUTATION, min_size=1, max_size=4), ask_other_key=st.booleans())
def test_fuzz_mutated_records(layout: KVLayout, num_tokens: int, seed: int,
                              mutations: list[tuple[str, int, int]], ask_other_key: bool) -> None:
    key = _key(layout, num_tokens, seed)
    with lease([_filled(layout, num_tokens, seed)]) as (obj,):
        original = _record(key, obj)
        payload = bytes(obj.byte_view())
    buf = bytearray(original)
    for op, pos, arg in mutations:
        _mutate(buf, op, pos, arg)
    asked = _key(layout, num_tokens, seed + 1) if ask_other_key else key
    got = _try_read(buf, asked, layout)
    if bytes(buf) == original and not ask_other_key:
        assert got == payload
    else:
        assert got is None


@_fuzz(2500)
@given(data=st.binary(max_size=600), layout=st.sampled_from(LAYOUTS), num_tokens=st.integers(1, 8))
def test_fuzz_random_bytes(data: bytes, layout: KVLayout, num_tokens: int) -> None:
    assert _try_read(data, _key(layout, num_tokens, 0), layout) is None


@_fuzz(2500)
@given(fields=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 255),
                        st.binary(min_size=8, max_size=8),
                        st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=4),
                        st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1),
                        st.integers(0, 64), st.integers(0, 2**16 - 1), st.integers(0, 255),
                        st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
       tail=st.binary(max_size=800))
def test_fuzz_plausible_prefixes(fields: tuple, tail: bytes) -> None:  # type: ignore[type-arg]
    """Records with the right magic and version but arbitrary other fields."""
    hlen, fmt, dtype, shape, plen, seg, ntok, klen, flags, csum, hsum = fields
    prefix = struct.pack("<4sHIB8s4IQIIHBQQ", b"KVTR", record.VERSION, hlen, fmt, dtype, *shape,
                         plen, seg, ntok, klen, flags, csum, hsum)
    assert len(prefix) == FIXED_SIZE
    assert _try_read(prefix + tail, _key(SMALL_MHA, 2, 0), SMALL_MHA) is None


def test_exhaustive_single_bit_flips_and_truncations() -> None:
    """Every single-bit flip and every truncation of one small record is rejected."""
    key = _key(SMALL_MLA, 1, seed=11)
    with lease([_filled(SMALL_MLA, 1, seed=12)]) as (obj,):
        original = _record(key, obj)
    assert _try_read(original, key, SMALL_MLA) is not None
    tried = 0
    for pos in range(len(original)):
        for bit in range(8):
            buf = bytearray(original)
            buf[pos] ^= 1 << bit
            assert _try_read(buf, key, SMALL_MLA) is None, (pos, bit)
            tried += 1
        assert _try_read(original[:pos], key, SMALL_MLA) is None, pos
        tried += 1
    assert tried >= 1000
