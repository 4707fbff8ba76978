"""Codecs for the lower tiers (disk, Redis): how a chunk's KV is stored in a record's payload.

`remote_serde` picks the codec a tier *writes*; every reader loads a record of any codec it
knows, whatever its own (a record names its codec in its header: `record.py`). The CPU tier
always holds the pool's dtype: a codec changes what a record stores, never what a hit scatters
into the pool (a decoded chunk has the pool's dtype and shape).

- `naive` (id 0): the arena's bytes as they are; exact, and read straight into the arena.
- `fp8` (id 1): float8 e4m3 (`torch.float8_e4m3fn`, max 448) with float32 scales, one byte a
  value. KV_2LTD (`[2, layers, tokens, hidden]`): K per channel (a scale per layer and hidden
  channel: key outliers live in fixed channels, KIVI's finding), V per token (a scale per
  layer and token: value rows are mixed by attention weights, so a row's own range matters).
  KV_MLA (`[1, layers, tokens, kv_dim]`): the latent is the key of every head, so it is scaled
  like K, per channel (the RoPE part's channels differ in range from the latent's by orders of
  magnitude; one scale per token would flush the small ones). Payload: the fp8 values in the
  tensor's order, then the per-channel scales `[layers, hidden]`, then (KV_2LTD) the per-token
  scales `[layers, tokens]`. A pool already one byte a value (fp8 / uint8 pools) is stored
  `naive` by every codec: there is nothing to gain.

A record is encoded on the tier's writer thread and decoded on the load path: a plain disk
record a piece of whole blocks at a time as it is read (`blocks` / `decode_blocks`, the scales
read first), into the arena object the load hands out only once the whole payload's checksum
holds (as a naive read lands in it); an encrypted one, or a Redis one, after the whole payload
was verified (checksum, or GCM tag) in a scratch buffer. Both run in the C++ kernel when it is
built (`kvtier.kernels.ops.codec_encode` / `codec_decode` / `codec_decode_blocks`:
single-threaded, without the GIL, decoding straight into the arena), else in torch
(`encode_torch` / `decode_torch`, the reference the kernel matches bit for bit).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import torch

from kvtier.errors import ConfigError
from kvtier.kernels import ops
from kvtier.memory import KVLayout, MemoryFormat, MemoryObj

__all__ = ["CODECS", "Codec", "Encoded", "FP8", "INT8", "NAIVE", "PASSED", "REFUSED", "ScaledCodec",
           "check_gate", "codec_by_id", "codec_named", "scratch"]

_E4M3 = torch.float8_e4m3fn
_FP8_MAX = 448.0
_TINY = 1e-12  # an all-zero channel or token: scale 1, stored as zeros


class Codec(ABC):
    """One way to store a chunk in a record. Stateless and thread-safe."""

    name: str
    id: int  # in the record header (4 bits): never reused for another codec

    def applies(self, layout: KVLayout) -> bool:
        """Whether records of `layout` are encoded (else they are stored `naive`)."""
        return True

    @abstractmethod
    def payload_nbytes(self, layout: KVLayout, num_tokens: int) -> int:
        """The exact payload length of a record of `num_tokens` tokens of `layout`."""

    @abstractmethod
    def stored_nbytes(self, obj: MemoryObj) -> int:
        """The payload length of a record of `obj` (what `encode(obj)` holds)."""

    @abstractmethod
    def encode(self, obj: MemoryObj, into: memoryview | None = None) -> Encoded | MemoryObj:
        """What a record of `obj` stores: `obj` itself (naive) or an `Encoded` copy, in a new
        buffer or in the first `stored_nbytes(obj)` bytes of `into` (then valid until the
        caller reuses `into`). Never modifies `obj`."""

    @abstractmethod
    def decode(self, payload: memoryview, obj: MemoryObj) -> None:
        """Write the chunk held in `payload` (verified, `payload_nbytes` long) into `obj`.

        Raises:
            ValueError: naming `payload` when its length does not fit `obj`.
        """

    def blocks(self, obj: MemoryObj) -> tuple[int, int] | None:
        """How a payload for `obj` is decoded a piece at a time (`decode_blocks`): (bytes of
        one block's values, how many blocks; block b is plane `b // layers`, layer `b % layers`,
        `tokens * hidden` one-byte values), the scales following the values as the payload's
        tail; None when it is not (naive, or the kernel does not take `obj`: decode it whole)."""
        return None

    def decode_blocks(self, values: memoryview, scales: memoryview, obj: MemoryObj,
                      first: int) -> None:
        """Decode blocks `[first, ...)` from their `values` and the payload's tail `scales` into
        those blocks of `obj`, as `decode` would. Only where `blocks(obj)` is not None."""
        raise NotImplementedError


class Encoded:
    """A chunk as a record stores it: looks like the `MemoryObj` it came from (fmt, tokens,
    tensor for the shape and dtype) but its bytes are the codec's payload."""

    __slots__ = ("source", "codec", "data")

    def __init__(self, source: MemoryObj, codec: Codec, data: memoryview) -> None:
        self.source, self.codec, self.data = source, codec, data

    @property
    def fmt(self) -> MemoryFormat:
        return self.source.fmt

    @property
    def num_tokens(self) -> int:
        return self.source.num_tokens

    @property
    def tensor(self) -> torch.Tensor:
        return self.source.tensor

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def byte_view(self) -> memoryview:
        return self.data


class _Naive(Codec):
    name, id = "naive", 0

    def payload_nbytes(self, layout: KVLayout, num_tokens: int) -> int:
        return layout.nbytes(num_tokens)

    def stored_nbytes(self, obj: MemoryObj) -> int:
        return obj.nbytes

    def encode(self, obj: MemoryObj, into: memoryview | None = None) -> MemoryObj:
        return obj

    def decode(self, payload: memoryview, obj: MemoryObj) -> None:
        if len(payload) != obj.nbytes:
            raise ValueError(f"payload: {len(payload)} bytes for an object of {obj.nbytes}")
        obj.byte_view()[:] = payload


class _FP8(Codec):
    name, id = "fp8", 1

    def applies(self, layout: KVLayout) -> bool:
        return layout.dtype.itemsize > 1

    @staticmethod
    def _parts(shape: tuple[int, ...]) -> tuple[int, int, int]:
        """Bytes of the values, of the per-channel scales and of the per-token scales."""
        planes, layers, tokens, hidden = shape
        values = planes * layers * tokens * hidden
        per_token = 4 * layers * tokens if planes == 2 else 0
        return values, 4 * layers * hidden, per_token

    def payload_nbytes(self, layout: KVLayout, num_tokens: int) -> int:
        if not self.applies(layout):
            return layout.nbytes(num_tokens)
        return sum(self._parts(layout.shape(num_tokens)))

    def stored_nbytes(self, obj: MemoryObj) -> int:
        if obj.tensor.dtype.itemsize == 1:
            return obj.nbytes
        return sum(self._parts(tuple(obj.tensor.shape)))

    def encode(self, obj: MemoryObj, into: memoryview | None = None) -> Encoded | MemoryObj:
        x = obj.tensor
        if x.dtype.itemsize == 1:
            return obj
        size = sum(self._parts(tuple(x.shape)))
        if into is not None and len(into) < size:
            raise ValueError(f"into: {len(into)} bytes for a payload of {size}")
        data = into[:size] if into is not None else memoryview(bytearray(size))
        # The C++ kernel when built (bit-identical, one pass per part, no float32 copies, the
        # GIL released: writer threads encode side by side), else torch.
        if not (_kernel_takes(x) and ops.codec_encode(x, _bytes(data), self.name)):
            self.encode_torch(x, data)
        return Encoded(obj, self, data)

    def encode_torch(self, x: torch.Tensor, data: memoryview) -> None:
        """The torch encoder of `x` (the chunk) into `data` (its payload length): the
        reference the C++ kernel matches bit for bit, and its fallback."""
        q, s_chan, s_tok = self._views(data, tuple(x.shape))
        # K (or MLA's latent): a scale per (layer, channel), over the chunk's tokens
        k = x[0].to(torch.float32, copy=True)  # never a view of the arena
        s_chan.copy_(k.abs().amax(dim=1).clamp_min(_TINY) / self._MAX)
        self._store(k.div_(s_chan[:, None, :]), q[0])
        if s_tok is not None:  # V: a scale per (layer, token), over its hidden values
            v = x[1].to(torch.float32, copy=True)
            s_tok.copy_(v.abs().amax(dim=2).clamp_min(_TINY) / self._MAX)
            self._store(v.div_(s_tok[:, :, None]), q[1])

    _MAX = _FP8_MAX  # the largest value stored

    @staticmethod
    def _store(y: torch.Tensor, q: torch.Tensor) -> None:
        q.copy_(y)  # rounds to the nearest e4m3 value

    @staticmethod
    def _load(q: torch.Tensor) -> tuple[torch.Tensor, float]:
        return _widen(q), _F16_UNIT

    def decode(self, payload: memoryview, obj: MemoryObj) -> None:
        shape = tuple(obj.tensor.shape)
        if obj.tensor.dtype.itemsize == 1:
            _NAIVE.decode(payload, obj)
            return
        if len(payload) != sum(self._parts(shape)):
            raise ValueError(f"payload: {len(payload)} bytes do not hold an {self.name} chunk "
                             f"of shape {shape}")
        out = obj.tensor
        if not (_kernel_takes(out) and ops.codec_decode(_bytes(payload), out, self.name)):
            self.decode_torch(payload, out)

    def blocks(self, obj: MemoryObj) -> tuple[int, int] | None:
        x = obj.tensor
        if x.dtype.itemsize == 1 or not (_kernel_takes(x) and ops.codec_blocks()):
            return None
        planes, layers, tokens, hidden = x.shape
        return tokens * hidden, planes * layers

    def decode_blocks(self, values: memoryview, scales: memoryview, obj: MemoryObj,
                      first: int) -> None:
        if not ops.codec_decode_blocks(_bytes(values), _bytes(scales), obj.tensor, first,
                                       self.name):
            raise RuntimeError("codec: the kernel's block calls went away")

    def decode_torch(self, payload: memoryview, out: torch.Tensor) -> None:
        """The torch decoder of `payload` (checked) into `out`: the kernel's reference."""
        q, s_chan, s_tok = self._views(payload, tuple(out.shape))
        wide, unit = self._load(q[0])
        torch.mul(wide, s_chan[:, None, :] * unit, out=out[0])
        if s_tok is not None:
            wide, unit = self._load(q[1])
            torch.mul(wide, s_tok[:, :, None] * unit, out=out[1])

    def _views(self, data: memoryview, shape: tuple[int, ...],
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The fp8 values and the two scale tensors, as views of `data` (no copy)."""
        values, per_channel, per_token = self._parts(shape)
        raw = torch.frombuffer(data, dtype=torch.uint8)
        _, layers, tokens, hidden = shape
        q = raw[:values].view(_E4M3).view(shape)
        s_chan = raw[values:values + per_channel].view(torch.float32).view(layers, hidden)
        s_tok = (raw[values + per_channel:].view(torch.float32).view(layers, tokens)
                 if per_token else None)
        return q, s_chan, s_tok


# e4m3 bits moved into a float16's (sign; exponent and mantissa 7 places up) read as float16
# are the fp8 value times 2**-8, subnormals included (both formats' subnormals line up), so
# `_widen` is exact; the 2**8 goes into the scale. Measured 8x faster than torch's own
# fp8 -> float conversion on this host's CPU (1.0 vs 8.6 ms for 1.5 M values, one thread).
_F16_UNIT = 256.0


def _kernel_takes(chunk: torch.Tensor) -> bool:
    """Whether the C++ codec kernel takes `chunk` (else torch codes it)."""
    return chunk.is_contiguous() and chunk.dtype in _KERNEL_DTYPES and chunk.device.type == "cpu"


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _bytes(data: memoryview) -> torch.Tensor:
    """`data` as a 1-D uint8 tensor sharing its memory."""
    return torch.frombuffer(data, dtype=torch.uint8)


def _widen(q: torch.Tensor) -> torch.Tensor:
    """`q` (float8 e4m3fn, finite) as float16 values 2**-8 times as large, exactly."""
    v = q.view(torch.int8).to(torch.int16)  # sign-extended: bit 15 is the sign
    return ((v << 7) & 0x3F80 | (v & -32768)).view(torch.float16)


class _Int8(_FP8):
    """int8 with the same scales as fp8 (symmetric, 127 levels each side): uniform steps keep
    small values within a channel or token better than e4m3's 3-bit mantissa keeps large
    ones; on SmolLM2 it moved the next-token distributions about 10x less (docs/codecs.md)."""

    name, id = "int8", 2
    _MAX = 127.0

    @staticmethod
    def _store(y: torch.Tensor, q: torch.Tensor) -> None:
        q.view(torch.int8).copy_(y.round_().clamp_(-127.0, 127.0))

    @staticmethod
    def _load(q: torch.Tensor) -> tuple[torch.Tensor, float]:
        return q.view(torch.int8).to(torch.float16), 1.0  # exact: |q| <= 127


ScaledCodec = _FP8  # fp8's and int8's class: their torch paths (`encode_torch`, `decode_torch`)
_NAIVE = _Naive()
NAIVE: Codec = _NAIVE
FP8: Codec = _FP8()
INT8: Codec = _Int8()
CODECS: dict[str, Codec] = {c.name: c for c in (NAIVE, FP8, INT8)}
_BY_ID = {c.id: c for c in CODECS.values()}


def codec_named(name: str) -> Codec:
    """The codec `remote_serde: name` selects.

    Raises:
        ValueError: naming `remote_serde` and the known codecs.
    """
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"remote_serde: unknown codec {name!r}; known: "
                         f"{', '.join(CODECS)}") from None


def codec_by_id(codec_id: int) -> Codec | None:
    """The codec a record header names, or None when this kvtier version does not know it."""
    return _BY_ID.get(codec_id)


# The quality gate's verdicts (benchmarks/serving/bench_quality.py --serde; docs/codecs.md):
# (codec, a model name's lower-case part) -> what the gate measured. A refused codec keeps an
# engine of that model from starting unless `remote_serde_override` is set; a model the gate
# never ran on starts with one warning.
PASSED: dict[tuple[str, str], str] = {}
REFUSED: dict[tuple[str, str], str] = {
    # 2026-12-06, 50 prompts: TP 1 (every chunk loaded from Redis) and TP 2 (every chunk
    # loaded from disk, and again from Redis) (benchmarks/LOG.md)
    ("fp8", "smollm2-135m"): "31 of 50 greedy answers identical at TP 1, 32 of 50 at TP 2, 48 "
                             "needed; first-token top-20 KL at most 3.0e-3",
    # 2026-12-06, TP 1 and TP 2, 20 prompts (time), every disk and Redis chunk int8
    ("int8", "smollm2-135m"): "17 of 20 greedy answers identical at TP 1 and at TP 2, 96% "
                              "needed; first-token top-20 KL at most 7.4e-5",
}


def check_gate(serde: str, model: str, override: bool) -> str | None:
    """Whether an engine of `model` may store `serde` records: None when it may (naive, or a
    gate it passed), a warning line when it may but was not gated (or refused and overridden).

    Raises:
        ConfigError: naming `remote_serde`, the model and why, when the gate refused `serde` for
            `model` and `override` (`remote_serde_override`) is false.
    """
    if serde == NAIVE.name:
        return None
    name = model.lower()
    for (codec, part), why in REFUSED.items():
        if codec == serde and part in name:
            if not override:
                raise ConfigError(f"remote_serde: {serde} failed its quality gate for model "
                                  f"{model!r} ({why}); use naive, or set "
                                  "remote_serde_override: true to store it anyway")
            return f"remote_serde: {serde} failed its quality gate for {model!r} ({why}); " \
                "stored anyway (remote_serde_override)"
    if any(codec == serde and part in name for codec, part in PASSED):
        return None
    return (f"remote_serde: {serde} was never gated on model {model!r} (docs/codecs.md: run "
            f"benchmarks/serving/bench_quality.py --serde {serde} on it)")


_local = threading.local()


def scratch(nbytes: int, use: str = "read") -> memoryview:
    """A writable buffer of `nbytes` bytes for the calling thread (contents undefined), reused
    by its next call for the same `use`: "read", where a compressed payload is read and
    verified before `decode`; "write", where a writer encodes a record it writes out before
    its next (a fresh buffer per record cost ~0.2 ms of page faults a 3 MB payload)."""
    buf: bytearray | None = getattr(_local, use, None)
    if buf is None or len(buf) < nbytes:
        buf = bytearray(nbytes)
        setattr(_local, use, buf)
    return memoryview(buf)[:nbytes]
