"""Multi-layer gather/scatter between a paged KV pool and one contiguous chunk.

A pool is N per-layer tensors `[num_slots, hidden]`; a chunk is one contiguous `[N, T, hidden]`
tensor. `gather` copies the rows named by `slots` out of every layer into the chunk, `scatter`
copies them back. Implementations, in order of preference: the CUDA kernel (pool on a GPU and
the kernels built with CUDA), the C++ CPU kernel, the PyTorch reference. `prepare()` loads the
kernels, compiling them if this environment has none (`build.py`); the engine calls it when it
is built, so the copies on a serving thread never compile (a copy before any `prepare()` uses a
kernel only if one is already built). The reference is always available and is the oracle the
kernels are tested against. `KVTIER_KERNEL=torch` forces the reference, `KVTIER_KERNEL=cpp`
requires the compiled kernels (an error if they cannot be built), `auto` (the default) picks
the fastest available.

`codec_encode` / `codec_decode` run the disk and Redis tiers' record codecs (fp8, int8:
`kvtier.backends.codec`, whose torch path stays their reference) in the same extension.

The kernels copy rows of bytes, so every dtype works (fp8 included). Every argument is checked
before anything is written: in C++ by the compiled kernels (they return an error, raised here by
`check_result`), here for the reference.

Loading and choosing the compiled extension is `kvtier.kernels.extension`'s, the reference is
`kvtier.kernels.reference`'s; both are re-exported here, so `ops` stays the one import.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from kvtier.background import copy_threads
from kvtier.kernels import checks
from kvtier.kernels.checks import CheckedLayers
from kvtier.kernels.extension import check_result, kernel_name, kernel_status, loaded, prepare
from kvtier.kernels.extension import kernel as _kernel
from kvtier.kernels.reference import reference_gather, reference_scatter

__all__ = ["gather", "scatter", "gather_chunks", "scatter_chunks", "prepare", "kernel_name",
           "kernel_status", "reference_gather", "reference_scatter", "CheckedLayers",
           "slot_bounds", "token_bytes", "check_result", "codec_encode", "codec_decode",
           "codec_decode_blocks", "codec_blocks"]


def gather(layers: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
    """`out[l, t] = layers[l][slots[t]]` for every layer l and token t.

    Args:
        layers: N contiguous 2-D tensors `[num_slots, hidden]` of one dtype, shape and device.
        slots: 1-D int64 `[T]` on the layers' device, every value in `[0, num_slots)`.
        out: contiguous `[N, T, hidden]` of the layers' dtype and device; fully overwritten.

    Raises:
        ValueError: naming the bad argument; nothing has been written.
    """
    # The kernel checks every argument itself, in C++, before it writes (with the messages
    # `checks.check` gives): checking them here too cost a third of a cold call's Python.
    ext = _kernel(checks.check_layers(layers).device)
    if ext is not None and isinstance(slots, torch.Tensor) and isinstance(out, torch.Tensor):
        return check_result(ext.gather(list(layers), slots, out, max_threads=copy_threads()))
    checks.check(layers, slots, out, "out", allow_skip=False)  # a non-tensor: named here
    reference_gather(layers, slots, out)


def scatter(src: torch.Tensor, slots: torch.Tensor, layers: Sequence[torch.Tensor]) -> None:
    """`layers[l][slots[t]] = src[l, t]` for every layer l and every token t with `slots[t] >= 0`.

    Args:
        src: contiguous `[N, T, hidden]`; never mutated.
        slots: 1-D int64 `[T]`, each value `-1` (row not touched) or in `[0, num_slots)`.
            When a slot repeats, which token's row lands there is unspecified.
        layers: N contiguous 2-D tensors `[num_slots, hidden]` of src's dtype and device.

    Raises:
        ValueError: naming the bad argument; nothing has been written.
    """
    ext = _kernel(checks.check_layers(layers).device)  # it checks the tensors, as in gather
    if ext is not None and isinstance(slots, torch.Tensor) and isinstance(src, torch.Tensor):
        return check_result(ext.scatter(src, slots, list(layers), max_threads=copy_threads()))
    checks.check(layers, slots, src, "src", allow_skip=True)
    reference_scatter(src, slots, layers)


def gather_chunks(layers: Sequence[torch.Tensor], slots: torch.Tensor,
                  outs: Sequence[torch.Tensor]) -> None:
    """`gather(layers, slots[o_c : o_c + T_c], outs[c])` for every chunk c in order (`o_c`: the
    tokens of the chunks before it), as one call: the slots are checked once and the kernel
    runs without returning to Python between chunks (a store of a whole prompt).

    Raises:
        ValueError: naming the bad argument; nothing has been written.
    """
    ext = _check_chunks(layers, slots, outs, "outs", allow_skip=False)
    if ext is not None:
        return check_result(ext.gather_chunks(list(layers), slots, list(outs),
                                             max_threads=copy_threads()))
    start = 0
    for out in outs:
        reference_gather(layers, slots[start:start + out.shape[1]], out)
        start += out.shape[1]


def scatter_chunks(srcs: Sequence[torch.Tensor], slots: torch.Tensor,
                   layers: Sequence[torch.Tensor]) -> None:
    """`scatter(srcs[c], slots[o_c : o_c + T_c], layers)` for every chunk c in order (`o_c`:
    the tokens of the chunks before it), as one call: the slots are checked once and the
    kernel runs without returning to Python between chunks (a load of a whole prompt).

    Raises:
        ValueError: naming the bad argument; nothing has been written.
    """
    ext = _check_chunks(layers, slots, srcs, "srcs", allow_skip=True)
    if ext is not None:
        return check_result(ext.scatter_chunks(list(srcs), slots, list(layers),
                                              max_threads=copy_threads()))
    start = 0
    for src in srcs:
        reference_scatter(src, slots[start:start + src.shape[1]], layers)
        start += src.shape[1]


def _check_chunks(layers: Sequence[torch.Tensor], slots: torch.Tensor,
                  chunks: Sequence[torch.Tensor], name: str, allow_skip: bool,
                  ) -> ModuleType | None:
    """Checks a copy between `layers` and consecutive `chunks`; returns the kernel, or None
    for the reference. The kernel checks the slots and every chunk itself, in C++, with the
    same messages: only what it cannot name (not a list of tensors) is checked here for it."""
    first = checks.check_layers(layers)
    ext = _kernel(first.device)
    if isinstance(chunks, torch.Tensor) or not chunks or \
            not all(isinstance(c, torch.Tensor) and c.dim() == 3 for c in chunks):
        raise ValueError(f"{name} must be a non-empty sequence of 3-D [layers, tokens, hidden] "
                         "tensors")
    if ext is not None and isinstance(slots, torch.Tensor):
        return ext
    checks.check_slots(slots, first, allow_skip=allow_skip)  # a non-tensor: named here
    total = sum(int(c.shape[1]) for c in chunks)
    if total != slots.numel():
        raise ValueError(f"{name} hold {total} tokens, slots has {slots.numel()}")
    if ext is None:
        for i, chunk in enumerate(chunks):
            checks.check_chunk(chunk, f"{name}[{i}]", first, len(layers), chunk.shape[1])
    return ext


def slot_bounds(slots: torch.Tensor) -> tuple[int, int] | None:
    """(min, max) of a non-empty contiguous 1-D CPU int64 tensor, in one pass of the compiled
    kernel; None for anything else or without the kernel (then use `torch.aminmax`)."""
    ext = loaded()
    return None if ext is None else ext.slot_bounds(slots)


def token_bytes(tokens: torch.Tensor) -> bytes | None:
    """A 1-D CPU int64/int32 tensor of token ids as little-endian uint32 bytes, in one pass of
    the compiled kernel (`ValueError` naming `token_ids` outside [0, 2**32)); None for anything
    else or without the kernel (then convert with numpy)."""
    ext = loaded()
    return None if ext is None else ext.token_bytes(tokens)


def codec_encode(chunk: torch.Tensor, payload: torch.Tensor, codec: str, *,
                 simd: bool = True) -> bool:
    """Encode `chunk` (contiguous CPU `[planes, layers, tokens, hidden]`, bf16/fp16/fp32) into
    `payload` (1-D uint8, the codec's payload length) as `kvtier.backends.codec` does for
    `codec` ("fp8" or "int8"), bit for bit, in one C++ pass per part on the calling thread,
    without the GIL. Returns False, writing nothing, when the compiled kernel is not used (see
    `prepare`; the caller encodes with torch). `simd=False` keeps the kernel off its AVX2 rows
    (for the tests: both must give the same bytes).

    Raises:
        ValueError: naming the bad argument; nothing has been written.
    """
    ext = _kernel(torch.device("cpu"))
    if ext is None or not hasattr(ext, "codec_encode"):
        return False
    check_result(ext.codec_encode(chunk, payload, codec, simd))
    return True


def codec_decode(payload: torch.Tensor, out: torch.Tensor, codec: str, *,
                 simd: bool = True) -> bool:
    """Decode `payload` (as `codec_encode` writes it) straight into `out` (contiguous CPU
    `[planes, layers, tokens, hidden]`), bit-identical to the torch decode. Returns False,
    writing nothing, when the compiled kernel is not used.

    Raises:
        ValueError: naming the bad argument; nothing has been written.
    """
    ext = _kernel(torch.device("cpu"))
    if ext is None or not hasattr(ext, "codec_decode"):
        return False
    check_result(ext.codec_decode(payload, out, codec, simd))
    return True


def codec_decode_blocks(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                        first: int, codec: str, *, simd: bool = True) -> bool:
    """`codec_decode` of blocks `[first, first + len(values) // block)` of `out` only (block b:
    plane `b // layers`, layer `b % layers`; `tokens * hidden` bytes of values), from their
    values (1-D uint8, whole blocks: the payload's bytes from `first * block`) and `scales`
    (1-D uint8, the payload's tail: its length less the values), bit for bit as `codec_decode`
    writes them. Returns False, writing nothing, when the compiled kernel is not used (or
    predates this call). `simd` as in `codec_encode`.

    Raises:
        ValueError: naming the bad argument; nothing has been written.
    """
    ext = _kernel(torch.device("cpu"))
    if ext is None or not hasattr(ext, "codec_decode_blocks"):
        return False
    check_result(ext.codec_decode_blocks(values, scales, out, first, codec, simd))
    return True


def codec_blocks() -> bool:
    """Whether `codec_decode_blocks` runs now (the compiled kernel is in use and has it), for a
    caller that plans its pieces before decoding any."""
    ext = _kernel(torch.device("cpu"))
    return ext is not None and hasattr(ext, "codec_decode_blocks")
