"""The lower tiers' codecs (kvtier/backends/codec.py) and how records name them (record.py)."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from kvtier.backends import codec, record
from kvtier.backends import codec as codec_mod
from kvtier.backends.codec import (
    CODECS,
    FP8,
    INT8,
    NAIVE,
    Codec,
    Encoded,
    check_gate,
    codec_by_id,
    codec_named,
)
from kvtier.config.schema import REMOTE_SERDES
from kvtier.errors import ConfigError, CorruptEntry
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj
from tests.helpers import make_keys, same_bytes

MHA16 = KVLayout.mha(num_layers=4, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)


def kv_like(alloc: MemoryAllocator, layout: KVLayout, tokens: int, seed: int = 0) -> MemoryObj:
    """An object holding KV-like values: normal, with a few outlier channels in K and a few
    loud tokens in V (what per-channel / per-token scales are for)."""
    obj = alloc.allocate(layout, tokens)
    assert obj is not None
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(obj.tensor.shape, generator=gen)
    x[0] *= 1 + 20 * (torch.rand(layout.hidden, generator=gen) > 0.9)  # outlier channels
    if layout.planes == 2:
        x[1] *= 1 + 5 * (torch.rand(tokens, 1, generator=gen) > 0.95)  # loud tokens
    obj.tensor.copy_(x)
    return obj


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per (plane, layer)."""
    a, b = a.float().flatten(2), b.float().flatten(2)
    return (a - b).norm(dim=2) / a.norm(dim=2)


def decoded(alloc: MemoryAllocator, obj: MemoryObj, layout: KVLayout,
            codec: Codec = FP8) -> MemoryObj:
    enc = codec.encode(obj)
    assert isinstance(enc, Encoded)
    assert enc.nbytes == codec.payload_nbytes(layout, obj.num_tokens)
    assert codec.stored_nbytes(obj) == enc.nbytes and NAIVE.stored_nbytes(obj) == obj.nbytes
    out = alloc.allocate(layout, obj.num_tokens)
    assert out is not None
    codec.decode(memoryview(bytearray(enc.byte_view())), out)
    return out


@pytest.mark.parametrize("codec", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize(("dtype", "ratio"), [(torch.bfloat16, 0.55), (torch.float16, 0.55),
                                              (torch.float32, 0.3)])
def test_one_byte_codecs_are_small_and_within_6_percent_per_layer(
        codec: Codec, dtype: torch.dtype, ratio: float) -> None:
    layout = KVLayout.mha(num_layers=4, num_kv_heads=3, head_dim=64, dtype=dtype)
    alloc = MemoryAllocator(32 << 20)
    obj = kv_like(alloc, layout, 256)
    before = obj.tensor.clone()
    out = decoded(alloc, obj, layout, codec)
    assert same_bytes(obj.tensor, before)  # encoding never touches the arena object
    assert codec.payload_nbytes(layout, 256) <= ratio * layout.nbytes(256)
    err = rel_l2(obj.tensor, out.tensor)
    assert err.shape == (2, 4) and float(err.max()) < 0.06 and float(err.min()) > 0
    if codec is INT8:  # uniform steps: closer than fp8 on these values
        fp8 = decoded(alloc, obj, layout, FP8)
        assert float(err.max()) < float(rel_l2(obj.tensor, fp8.tensor).min())
        fp8.release()
    obj.release()
    out.release()


def test_fp8_mla_scales_per_channel_and_keeps_small_channels() -> None:
    layout = KVLayout.mla(num_layers=2, kv_dim=576, dtype=torch.bfloat16)
    alloc = MemoryAllocator(32 << 20)
    obj = kv_like(alloc, layout, 128)
    obj.tensor[0, :, :, 512:] *= 1e-3  # a rope part far quieter than the latent
    out = decoded(alloc, obj, layout)
    assert FP8.payload_nbytes(layout, 128) == 2 * 128 * 576 + 4 * 2 * 576
    assert float(rel_l2(obj.tensor, out.tensor).max()) < 0.06
    quiet = rel_l2(obj.tensor[..., 512:], out.tensor[..., 512:])
    assert float(quiet.max()) < 0.06  # one scale per token would have flushed these to zero
    obj.release()
    out.release()


def test_fp8_zero_chunk_and_one_byte_pools() -> None:
    alloc = MemoryAllocator(8 << 20)
    obj = alloc.allocate(MHA16, 16)
    assert obj is not None
    obj.tensor.zero_()
    out = decoded(alloc, obj, MHA16)
    assert not out.tensor.any()  # all-zero channels: no NaN from a zero scale
    fp8_pool = KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.uint8)
    raw = alloc.allocate(fp8_pool, 16)
    assert raw is not None
    assert FP8.encode(raw) is raw and not FP8.applies(fp8_pool)  # nothing to gain: naive
    assert FP8.payload_nbytes(fp8_pool, 16) == fp8_pool.nbytes(16)
    for o in (obj, out, raw):
        o.release()


@pytest.mark.parametrize("codec", [FP8, INT8], ids=["fp8", "int8"])
def test_encode_into_a_reused_buffer_gives_the_same_record(codec: Codec) -> None:
    """A writer encodes into its thread's reused buffer (codec.scratch "write", not the loads'
    "read" one): the same bytes as a fresh encode, held in that buffer; a short one is refused
    before anything is written."""
    alloc = MemoryAllocator(8 << 20)
    obj = kv_like(alloc, MHA16, 64, seed=7)
    fresh = codec.encode(obj)
    assert isinstance(fresh, Encoded)
    into = codec_mod.scratch(codec.stored_nbytes(obj) + 100, "write")
    into[:] = b"\xAA" * len(into)
    enc = codec.encode(obj, into)
    assert isinstance(enc, Encoded) and bytes(enc.byte_view()) == bytes(fresh.byte_view())
    assert bytes(into[:enc.nbytes]) == bytes(fresh.byte_view())  # written in place
    assert bytes(into[enc.nbytes:]) == b"\xAA" * 100  # and nothing past the payload
    read = codec_mod.scratch(16)
    read[:] = b"\x00" * 16
    assert bytes(into[:16]) == bytes(fresh.byte_view()[:16])  # the loads' buffer is another
    with pytest.raises(ValueError, match="into"):
        codec.encode(obj, memoryview(bytearray(enc.nbytes - 1)))
    obj.release()


def test_naive_is_the_arena_bytes_and_decode_checks_length() -> None:
    alloc = MemoryAllocator(8 << 20)
    obj = kv_like(alloc, MHA16, 16)
    assert NAIVE.encode(obj) is obj and NAIVE.payload_nbytes(MHA16, 16) == MHA16.nbytes(16)
    with pytest.raises(ValueError, match="payload"):
        FP8.decode(memoryview(bytearray(10)), obj)
    obj.release()


def test_codec_table_matches_the_config_choices() -> None:
    assert tuple(CODECS) == REMOTE_SERDES
    assert codec_by_id(1) is FP8 and codec_by_id(0) is NAIVE and codec_by_id(2) is INT8
    assert codec_by_id(9) is None
    with pytest.raises(ValueError, match="remote_serde.*zstd"):
        codec_named("zstd")


def _record(obj: MemoryObj, layout: KVLayout) -> tuple[bytes, record.RecordHeader]:
    key = make_keys(obj.num_tokens, chunk_size=obj.num_tokens, layout=layout)[0]
    enc = FP8.encode(obj)
    head = record.encode_header(key, enc)
    return head + bytes(enc.byte_view()), record.parse_header(head, key, layout)


def test_a_record_names_its_codec_and_its_checksum_covers_the_compressed_bytes() -> None:
    alloc = MemoryAllocator(8 << 20)
    obj = kv_like(alloc, MHA16, 32)
    buf, head = _record(obj, MHA16)
    assert head.codec is FP8 and head.payload_len == FP8.payload_nbytes(MHA16, 32)
    assert head.dtype == "bf16" and head.shape == MHA16.shape(32)  # what it decodes to
    flags = buf[record.FIXED_SIZE - 17]
    assert flags >> 4 == FP8.id and flags not in (0, 1, 3)  # older readers: OtherVersion
    payload = bytearray(buf[head.header_len:])
    record.verify_payload(head, payload)
    payload[7] ^= 1
    with pytest.raises(CorruptEntry, match="checksum"):
        record.verify_payload(head, payload)
    obj.release()


def test_an_unknown_codec_is_another_version_naming_it() -> None:
    alloc = MemoryAllocator(8 << 20)
    obj = kv_like(alloc, MHA16, 32)
    key = make_keys(32, chunk_size=32, layout=MHA16)[0]
    head = bytearray(record.encode_header(key, FP8.encode(obj)))
    at = record.FIXED_SIZE - 17  # the flags byte
    head[at] = (7 << 4) | (head[at] & 0xF)
    body = bytes(head[:record.FIXED_SIZE - 8]) + bytes(head[record.FIXED_SIZE:])
    # the header re-checksummed, as a newer kvtier would write it
    head[record.FIXED_SIZE - 8:record.FIXED_SIZE] = struct.pack(
        "<Q", xxhash.xxh3_64_intdigest(body))
    with pytest.raises(record.OtherVersion, match="codec: id 7"):
        record.parse_header(bytes(head), key, MHA16)
    obj.release()


def test_a_refused_codec_stops_its_model_unless_overridden(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(codec.REFUSED, ("fp8", "tiny-model"), "12 of 50 identical")
    monkeypatch.setitem(codec.PASSED, ("fp8", "good-model"), "50 of 50 identical")
    with pytest.raises(ConfigError, match="remote_serde.*fp8.*Tiny-Model-1B.*12 of 50.*"
                                          "remote_serde_override"):
        check_gate("fp8", "org/Tiny-Model-1B", override=False)
    said = check_gate("fp8", "org/Tiny-Model-1B", override=True)
    assert said is not None and "anyway" in said
    assert check_gate("fp8", "org/Good-Model-7B", override=False) is None
    with pytest.raises(ConfigError, match="SmolLM2.*31 of 50"):  # the measured verdict
        check_gate("fp8", "HuggingFaceTB/SmolLM2-135M-Instruct", override=False)
    assert check_gate("naive", "org/Tiny-Model-1B", override=False) is None
    unknown = check_gate("fp8", "other/model", override=False)
    assert unknown is not None and "never gated" in unknown
