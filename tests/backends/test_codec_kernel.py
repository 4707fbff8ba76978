"""The C++ record codecs (kvtier/kernels/csrc/kv_codec.cpp) against codec.py's torch path, bit
for bit: encode, decode (whole, and a load's piece by piece), both round trips, the edge values
of e4m3 and int8 rounding, the fallback to torch, and the kernel's argument checks.

The compiled kernels are prepared (built on first use) before each test, as tests/kernels loads
them: a machine that cannot build them fails these tests (the kernel calls return False)
instead of skipping.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtier.backends.codec import FP8, INT8, Encoded, ScaledCodec
from kvtier.kernels import ops
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj

REPO = Path(__file__).resolve().parents[2]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CODECS = [FP8, INT8]
assert isinstance(FP8, ScaledCodec) and isinstance(INT8, ScaledCodec)
# hidden 36 and 44: whole AVX2 blocks of 8 and a tail of 4 (a record's scales must start
# 4-byte aligned for the torch path, so values come in multiples of 4)
LAYOUTS = {"mha": lambda d: KVLayout.mha(num_layers=3, num_kv_heads=3, head_dim=12, dtype=d),
           "mla": lambda d: KVLayout.mla(num_layers=2, kv_dim=44, dtype=d)}


@pytest.fixture(autouse=True)
def _auto_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_KERNEL", raising=False)
    ops.prepare()


@pytest.fixture
def alloc() -> MemoryAllocator:
    return MemoryAllocator(1 << 24)


def chunk(alloc: MemoryAllocator, layout: KVLayout, tokens: int, seed: int) -> MemoryObj:
    """KV-like values over many magnitudes: outlier channels, an all-zero channel, a channel
    of values far below the others (flushed by its scale), loud V tokens, a silent one."""
    obj = alloc.allocate(layout, tokens)
    assert obj is not None
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(obj.tensor.shape, generator=gen)
    x *= torch.logspace(-3, 2, x.shape[-1])[torch.randperm(x.shape[-1], generator=gen)]
    x[..., 1] = 0.0
    x[..., 2] *= 1e-30
    if layout.planes == 2:
        x[1] *= 1 + 5 * (torch.rand(tokens, 1, generator=gen) > 0.9)
        x[1, -1, 0] = 0.0  # a silent V token after a loud layer: its scale is the tiny one
    obj.tensor.copy_(x)
    return obj


def torch_payload(codec: ScaledCodec, x: torch.Tensor) -> bytes:
    data = memoryview(bytearray(_nbytes(codec, x)))
    codec.encode_torch(x, data)
    return bytes(data)


def _nbytes(codec: ScaledCodec, x: torch.Tensor) -> int:
    planes, layers, tokens, hidden = x.shape
    return planes * layers * tokens * hidden + 4 * layers * hidden + \
        (4 * layers * tokens if planes == 2 else 0)


def kernel_payload(codec: ScaledCodec, x: torch.Tensor, simd: bool = True) -> bytes:
    out = torch.full((_nbytes(codec, x),), 0xAB, dtype=torch.uint8)
    assert ops.codec_encode(x, out, codec.name, simd=simd)
    return out.numpy().tobytes()


def torch_decoded(codec: ScaledCodec, payload: bytes, like: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(like, 7.0)
    codec.decode_torch(memoryview(bytearray(payload)), out)
    return out


def kernel_decoded(codec: ScaledCodec, payload: bytes, like: torch.Tensor,
                   simd: bool = True) -> torch.Tensor:
    out = torch.full_like(like, 7.0)
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    assert ops.codec_decode(raw, out, codec.name, simd=simd)
    return out


@pytest.fixture(params=["avx512", "avx2", "plain"])
def simd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The kernel's rows under test: AVX-512 (where the CPU has it; else AVX2 again), AVX2
    (`KVTIER_CODEC_AVX512=0`), plain C++ (`simd=False`)."""
    if request.param == "avx2":
        monkeypatch.setenv("KVTIER_CODEC_AVX512", "0")
    return request.param != "plain"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_encodes_and_decodes_bit_for_bit_as_torch(
        alloc: MemoryAllocator, dtype: torch.dtype, layout: str, codec: ScaledCodec,
        simd: bool) -> None:
    lay = LAYOUTS[layout](dtype)
    for seed, tokens in ((0, 37), (1, 256)):
        x = chunk(alloc, lay, tokens, seed).tensor
        ref = torch_payload(codec, x)
        assert kernel_payload(codec, x, simd) == ref
        assert torch.equal(bits(kernel_decoded(codec, ref, x, simd)),
                           bits(torch_decoded(codec, ref, x)))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trips_across_the_two_paths_agree(
        alloc: MemoryAllocator, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
        codec: ScaledCodec) -> None:
    """Through the codec's own encode/decode: a record the kernel wrote reads back the same
    through torch, and one torch wrote the same through the kernel."""
    lay = LAYOUTS["mha"](dtype)
    obj = chunk(alloc, lay, 64, 3)
    kernel_rec = codec.encode(obj)
    monkeypatch.setenv("KVTIER_KERNEL", "torch")
    torch_rec = codec.encode(obj)
    assert isinstance(kernel_rec, Encoded) and isinstance(torch_rec, Encoded)
    assert bytes(kernel_rec.byte_view()) == bytes(torch_rec.byte_view())
    outs = {}
    for writer, rec in (("kernel", kernel_rec), ("torch", torch_rec)):
        for reader in ("kernel", "torch"):
            if reader == "torch":
                monkeypatch.setenv("KVTIER_KERNEL", "torch")
            else:
                monkeypatch.delenv("KVTIER_KERNEL", raising=False)
            out = alloc.allocate(lay, 64)
            assert out is not None
            codec.decode(memoryview(bytearray(rec.byte_view())), out)
            outs[writer, reader] = bits(out.tensor).clone()
            out.release()
        monkeypatch.delenv("KVTIER_KERNEL", raising=False)
    first = outs["kernel", "kernel"]
    assert all(torch.equal(first, o) for o in outs.values())
    assert not torch.equal(first, bits(obj.tensor))  # lossy: a real round trip, not a copy


def _with_unit_scales(values: torch.Tensor, top: float) -> torch.Tensor:
    """A float32 MLA chunk [1, 1, tokens, 16] holding `values` (padded with zeros), each channel
    led by `top` (the codec's largest stored value): every scale is exactly 1, so each value
    is quantized as it is."""
    width = 16
    pad = (-values.numel()) % width
    body = torch.cat([values.float(), torch.zeros(pad)]).view(-1, width)
    return torch.cat([torch.full((1, width), top), body]).view(1, 1, -1, width).contiguous()


def _e4m3_edges() -> torch.Tensor:
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()  # every e4m3 value, both signs, zeros
    mids = (grid[1:] + grid[:-1]) / 2  # ties (exact in float32), subnormal ones included
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-38, 2.0 ** -10, 2.0 ** -6 - 2.0 ** -12,
                         2.0 ** -6, 447.99, 448.0, -448.0, 432.0, 440.0])
    # every float32 bit pattern from 0 up to 448, one in 251
    sweep = torch.arange(0, 0x43E00001, 251, dtype=torch.int64).to(torch.int32).view(
        torch.float32)
    return torch.cat([grid, mids, up, down, tiny, sweep, -sweep])


def test_fp8_rounds_edge_values_as_torch(simd: bool) -> None:
    values = _e4m3_edges()
    x = _with_unit_scales(values, 448.0)
    payload = kernel_payload(FP8, x, simd)
    assert payload == torch_payload(FP8, x)
    q = torch.frombuffer(bytearray(payload), dtype=torch.uint8)[:x.numel()]
    expect = x.flatten().to(torch.float8_e4m3fn).view(torch.uint8)  # scales are 1
    assert torch.equal(q, expect)
    back = kernel_decoded(FP8, payload, x, simd)
    assert torch.equal(bits(back), bits(torch_decoded(FP8, payload, x)))


def _every_bf16(hidden: int) -> torch.Tensor:
    """A bf16 KV chunk [2, 2, tokens, hidden] holding every finite bf16 value of magnitude at
    most 448 (zeros padding it), token 0 and channel 0 all 448: every scale is exactly 1, so
    each value is quantized as it is (every e4m3 value, tie and subnormal tie is a bf16)."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[every.float().abs() <= 448.0]
    width = hidden - 1
    pad = (-every.numel()) % (2 * 2 * width)
    body = torch.cat([every, torch.zeros(pad, dtype=torch.bfloat16)]).view(2, 2, -1, width)
    body = torch.cat([torch.full((2, 2, body.shape[2], 1), 448.0, dtype=torch.bfloat16), body],
                     dim=3)
    lead = torch.full((2, 2, 1, hidden), 448.0, dtype=torch.bfloat16)
    return torch.cat([lead, body], dim=2).contiguous()


@pytest.mark.parametrize("hidden", [96, 100, 48])  # 64 + 32; 64 + 32 + a tail; 32 + a tail
def test_fp8_from_bf16_rounds_every_bf16_value_as_torch(simd: bool, hidden: int) -> None:
    """The AVX-512 rows' bf16 -> fp8 path (64 and 32 values a step, its own rounding) gives
    torch's bytes for every bf16 input, under unit scales and under scales of every size."""
    x = _every_bf16(hidden)
    payload = kernel_payload(FP8, x, simd)
    assert payload == torch_payload(FP8, x)
    q = torch.frombuffer(bytearray(payload), dtype=torch.uint8)[:x.numel()]
    assert torch.equal(q, x.flatten().float().to(torch.float8_e4m3fn).view(torch.uint8))
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):  # per-channel and per-token factors from 2**-40 to 2**40
        f = torch.exp2(torch.randint(-40, 41, (1, 1, 1, hidden), generator=gen).float()) * \
            torch.exp2(torch.randint(-40, 41, (1, 1, x.shape[2], 1), generator=gen).float())
        y = (x.float() * f * (1 + torch.rand(f.shape, generator=gen))).to(torch.bfloat16)
        assert kernel_payload(FP8, y.contiguous(), simd) == torch_payload(FP8, y.contiguous())


def test_int8_rounds_ties_to_even_and_clamps_as_torch(simd: bool) -> None:
    halves = torch.arange(-254, 255, dtype=torch.float32) / 2  # every .5 tie in [-127, 127]
    near = torch.cat([torch.nextafter(halves, torch.tensor(1e9)),
                      torch.nextafter(halves, torch.tensor(-1e9))])
    near = near[near.abs() <= 127]  # beyond, a channel's scale would no longer be 1
    values = torch.cat([halves, near, torch.tensor([0.0, -0.0, 1e-45, 126.5, -126.5, 127.0]),
                        torch.empty(100_000).uniform_(-127, 127)])
    x = _with_unit_scales(values, 127.0)
    payload = kernel_payload(INT8, x, simd)
    assert payload == torch_payload(INT8, x)
    q = torch.frombuffer(bytearray(payload), dtype=torch.int8)[:x.numel()]
    assert torch.equal(q, x.flatten().round().clamp(-127, 127).to(torch.int8))
    assert torch.equal(bits(kernel_decoded(INT8, payload, x, simd)),
                       bits(torch_decoded(INT8, payload, x)))


def test_decode_reads_every_byte_as_torch_does(simd: bool) -> None:
    """Any payload, not only an encoder's: all 256 byte values (fp8's NaN patterns 0x7F/0xFF
    included) under scales of every magnitude."""
    gen = torch.Generator().manual_seed(5)
    like = torch.empty(2, 2, 64, 256, dtype=torch.bfloat16)
    values = torch.arange(256, dtype=torch.uint8).repeat(2 * 2 * 64)
    scales = torch.exp2(torch.randint(-60, 60, (2 * 256 + 2 * 64,), generator=gen).float()) * \
        torch.rand(2 * 256 + 2 * 64, generator=gen)
    payload = values.numpy().tobytes() + scales.numpy().tobytes()
    for codec in CODECS:
        for dtype in DTYPES:
            x = like.to(dtype)
            assert torch.equal(bits(kernel_decoded(codec, payload, x, simd)),
                               bits(torch_decoded(codec, payload, x))), (codec.name, dtype)


def test_decode_into_bf16_under_tiny_or_huge_scales_reads_as_torch(simd: bool) -> None:
    """Scales whose products are subnormal, zero or overflow to infinity: where the CPU has
    AVX512-BF16 the kernel rounds bf16 with one instruction only for payloads without the
    first, and must read all of these as torch does. (A NaN product, 0 x an infinite scale,
    is outside the contract: torch's own bf16 NaN bits vary.)"""
    like = torch.empty(2, 2, 16, 32, dtype=torch.bfloat16)
    values = torch.arange(256, dtype=torch.uint8).repeat(2 * 2 * 16 * 32 // 256)
    for odd in (1e-40, 1e-35, 3e-33, 0.0, 1e36, 1e-30):
        scales = torch.ones(2 * 32 + 2 * 16)
        scales[::7] = odd
        payload = values.numpy().tobytes() + scales.numpy().tobytes()
        for codec in CODECS:
            assert torch.equal(bits(kernel_decoded(codec, payload, like, simd)),
                               bits(torch_decoded(codec, payload, like))), (codec.name, odd)


def pieces_decoded(codec: ScaledCodec, payload: bytes, like: torch.Tensor, step: int,
                   simd: bool = True) -> torch.Tensor:
    """`payload` decoded as a load does: `step` whole blocks of values a call, with the tail."""
    planes, layers, tokens, hidden = like.shape
    block, count = tokens * hidden, planes * layers
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out = torch.full_like(like, 7.0)
    for first in range(0, count, step):
        part = raw[first * block : min(first + step, count) * block]
        assert ops.codec_decode_blocks(part, raw[block * count :], out, first, codec.name,
                                       simd=simd)
    return out


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decoding_piece_by_piece_gives_the_torch_decode_of_the_whole(
        alloc: MemoryAllocator, dtype: torch.dtype, layout: str, codec: ScaledCodec,
        simd: bool) -> None:
    """In pieces of one block, of two (V's first layer after K's last, for MHA) or all: an
    encoded chunk, and a payload whose scales would make some products subnormal (where the
    CPU has AVX512-BF16, only some pieces may take its bf16 rows)."""
    lay = LAYOUTS[layout](dtype)
    x = chunk(alloc, lay, 37, 2).tensor
    odd = bytearray(torch_payload(codec, x))
    tail = torch.frombuffer(odd, dtype=torch.uint8)[x.numel():].view(torch.float32)
    tail[-3] = 1e-40  # the last block's scales only
    for payload in (torch_payload(codec, x), bytes(odd)):
        want = bits(torch_decoded(codec, payload, x))
        for step in (1, 2, x.shape[0] * x.shape[1]):
            assert torch.equal(bits(pieces_decoded(codec, payload, x, step, simd)), want), step


def test_without_the_kernel_the_codecs_use_torch(alloc: MemoryAllocator,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    obj = chunk(alloc, LAYOUTS["mha"](torch.bfloat16), 32, 4)
    expect = kernel_payload(FP8, obj.tensor)
    monkeypatch.setenv("KVTIER_KERNEL", "torch")
    assert not ops.codec_encode(obj.tensor, torch.empty(len(expect), dtype=torch.uint8), "fp8")
    rec = FP8.encode(obj)
    assert isinstance(rec, Encoded) and bytes(rec.byte_view()) == expect


FALLBACK = textwrap.dedent("""
    import hashlib, torch
    from kvtier.backends.codec import FP8
    from kvtier.kernels import build, ops
    from kvtier.memory import KVLayout, MemoryAllocator
    from tests.backends.test_codec_kernel import chunk, LAYOUTS
    alloc = MemoryAllocator(1 << 24)
    obj = chunk(alloc, LAYOUTS["mha"](torch.bfloat16), 32, 4)
    rec = FP8.encode(obj)
    out = alloc.allocate(LAYOUTS["mha"](torch.bfloat16), 32)
    FP8.decode(memoryview(bytearray(rec.byte_view())), out)
    print(hashlib.sha256(bytes(rec.byte_view())).hexdigest(),
          hashlib.sha256(out.tensor.view(torch.uint8).numpy().tobytes()).hexdigest(),
          ops.kernel_name(), len(build.builds()))
""")


def test_a_process_without_a_built_kernel_codes_with_torch(alloc: MemoryAllocator,
                                                           tmp_path: Path) -> None:
    """No kernel built for this environment (an empty cache): records still encode and
    decode, with torch, to the same bytes, and nothing compiles on the way."""
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path / "empty")}
    env.pop("KVTIER_KERNEL", None)
    run = subprocess.run([sys.executable, "-c", FALLBACK], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    obj = chunk(alloc, LAYOUTS["mha"](torch.bfloat16), 32, 4)
    payload = kernel_payload(FP8, obj.tensor)
    decoded = kernel_decoded(FP8, payload, obj.tensor)
    assert run.stdout.split() == [hashlib.sha256(payload).hexdigest(),
                                  hashlib.sha256(bits(decoded).numpy().tobytes()).hexdigest(),
                                  "torch", "0"]


def test_bad_arguments_raise_value_error_naming_them_and_write_nothing() -> None:
    x = torch.randn(2, 2, 4, 8)
    good = _nbytes(FP8, x)
    payload = torch.full((good,), 0xAB, dtype=torch.uint8)
    cases = [
        (lambda: ops.codec_encode(x, payload[:-1], "fp8"), "payload"),
        (lambda: ops.codec_encode(x, payload.view(-1, 4), "fp8"), "payload"),
        (lambda: ops.codec_encode(x.to(torch.float64), payload, "fp8"), "chunk"),
        (lambda: ops.codec_encode(x[0], payload, "fp8"), "chunk"),
        (lambda: ops.codec_encode(x.transpose(2, 3), payload, "fp8"), "chunk"),
        (lambda: ops.codec_encode(torch.randn(3, 2, 4, 8), payload, "fp8"), "chunk"),
        (lambda: ops.codec_encode(x, payload, "fp4"), "codec"),
        (lambda: ops.codec_decode(payload, x.transpose(2, 3), "int8"), "out"),
        (lambda: ops.codec_decode(payload[1:], x, "int8"), "payload"),
        (lambda: ops.codec_decode(payload, x, "nf4"), "codec"),
        (lambda: ops.codec_decode_blocks(payload[:31], payload[-96:], x, 0, "fp8"), "values"),
        (lambda: ops.codec_decode_blocks(payload[:32], payload[-96:], x, 4, "fp8"), "first"),
        (lambda: ops.codec_decode_blocks(payload[:64], payload[-96:], x, 3, "fp8"), "first"),
        (lambda: ops.codec_decode_blocks(payload[:32], payload[-95:], x, 0, "fp8"), "scales"),
        (lambda: ops.codec_decode_blocks(payload[:32], payload[-96:], x[0], 0, "fp8"), "out"),
    ]
    before = x.clone()
    for call, name in cases:
        with pytest.raises(ValueError, match=f"^{name}"):
            call()
    assert bool((payload == 0xAB).all()) and torch.equal(x, before)
