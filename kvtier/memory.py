"""Memory objects and the arena they live in.

A `MemoryObj` holds one chunk of KV in a fixed layout (`MemoryFormat`) as a view into a single
arena allocated once at start-up. The arena is page-locked when CUDA is present so that
device copies can be asynchronous, and faulted in up front so the hot path never page-faults.

Ownership: an object is born with one reference held by whoever allocated it. `retain()` adds
one, `release()` drops one; the last release returns the bytes to the arena. Backends that keep
an object (the CPU tier) retain it; everything handed to a caller is a reference the caller must
release (use `lease()` to do that on every path).
"""

from __future__ import annotations

import bisect
import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["MemoryFormat", "KVLayout", "MemoryObj", "MemoryAllocator", "dtype_name", "DTYPES"]

logger = logging.getLogger(__name__)

ALIGN = 4096

# Stable names for the dtypes kvtier stores; they appear in keys and in record headers, so a
# name must never change meaning. fp8 pools are stored as uint8 (SGLang's `store_dtype`).
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "u8": torch.uint8,
    "i8": torch.int8,
    "fp8e4m3": torch.float8_e4m3fn,
    "fp8e5m2": torch.float8_e5m2,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The stable short name of `dtype`; `ValueError` for dtypes kvtier does not store."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not supported; supported: {sorted(DTYPES)}"
        ) from None


class MemoryFormat(enum.IntEnum):
    """How a chunk's bytes are laid out. The integer values are part of the record format."""

    KV_2LTD = 1  # [2, num_layers, num_tokens, hidden]: K then V
    KV_MLA = 2  # [1, num_layers, num_tokens, kv_dim]


@dataclass(frozen=True)
class KVLayout:
    """The shape of one model's KV cache as kvtier stores it (per TP rank)."""

    fmt: MemoryFormat
    num_layers: int
    hidden: int  # num_kv_heads * head_dim for MHA, kv_dim for MLA
    dtype: torch.dtype
    num_kv_heads: int = 1
    head_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        dtype_name(self.dtype)

    @classmethod
    def mha(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> KVLayout:
        """Layout of an MHA/GQA pool: K and V with `num_kv_heads * head_dim` values per token."""
        if not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        if not isinstance(num_kv_heads, int) or num_kv_heads <= 0:
            raise ValueError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
        return cls(MemoryFormat.KV_2LTD, num_layers, num_kv_heads * head_dim, dtype,
                   num_kv_heads, head_dim)

    @classmethod
    def mla(cls, num_layers: int, kv_dim: int, dtype: torch.dtype) -> KVLayout:
        """Layout of an MLA pool: one latent vector of `kv_dim` values per token."""
        return cls(MemoryFormat.KV_MLA, num_layers, kv_dim, dtype, 1, kv_dim)

    @property
    def planes(self) -> int:
        return 2 if self.fmt is MemoryFormat.KV_2LTD else 1

    def shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (self.planes, self.num_layers, num_tokens, self.hidden)

    def nbytes(self, num_tokens: int) -> int:
        return self.planes * self.num_layers * num_tokens * self.hidden * self.dtype.itemsize

    def fingerprint(self, chunk_size: int) -> str:
        """Everything about the layout that changes the stored bytes, as a key component."""
        if self.fmt is MemoryFormat.KV_2LTD:
            body = f"mha-L{self.num_layers}-H{self.num_kv_heads}x{self.head_dim}"
        else:
            body = f"mla-L{self.num_layers}-D{self.hidden}"
        return f"{body}-{dtype_name(self.dtype)}-c{chunk_size}"


class MemoryObj:
    """One chunk of KV: `tensor` is a `[planes, layers, tokens, hidden]` view into the arena."""

    __slots__ = ("tensor", "fmt", "num_tokens", "offset", "nbytes", "_refs", "_arena",
                 "__weakref__")

    def __init__(self, arena: MemoryAllocator, offset: int, layout: KVLayout, num_tokens: int):
        self._arena = arena
        self.offset = offset
        self.nbytes = layout.nbytes(num_tokens)
        self.fmt = layout.fmt
        self.num_tokens = num_tokens
        # One as_strided on the arena's typed view (offsets are ALIGN-aligned, so whole
        # elements): a third of the cost of slicing, then viewing twice.
        shape = layout.shape(num_tokens)
        self.tensor = arena.typed(layout.dtype).as_strided(
            shape, (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1),
            offset // layout.dtype.itemsize)
        self._refs = 1

    @property
    def refs(self) -> int:
        return self._refs

    def byte_view(self) -> memoryview:
        """A writable, zero-copy memoryview of the object's bytes (for I/O straight to/from it)."""
        return self._arena.view[self.offset : self.offset + self.nbytes]

    def retain(self) -> MemoryObj:
        with self._arena.lock:
            if self._refs <= 0:
                raise RuntimeError("retain() on a released MemoryObj")
            self._refs += 1
        return self

    def release(self) -> None:
        with self._arena.lock:
            if self._refs <= 0:
                raise RuntimeError("release() on a released MemoryObj")
            self._refs -= 1
            if self._refs == 0:
                self._arena._free_locked(self.offset, self.nbytes)

    def __repr__(self) -> str:
        return (f"MemoryObj({self.fmt.name}, tokens={self.num_tokens}, offset={self.offset}, "
                f"nbytes={self.nbytes}, refs={self._refs})")


@contextmanager
def lease(objs: list[MemoryObj]) -> Iterator[list[MemoryObj]]:
    """Release every object in `objs` when the block exits, however it exits."""
    try:
        yield objs
    finally:
        for obj in objs:
            obj.release()


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class MemoryAllocator:
    """A first-fit allocator with coalescing over one arena. Thread-safe; never busy-waits.

    When the arena is full, `allocate` calls the evictor (set by the storage manager) once,
    outside the lock, and retries; if that frees too little it returns `None` at once.
    """

    def __init__(self, size_bytes: int, *, pin: bool | None = None):
        if size_bytes < ALIGN:
            raise ValueError(f"arena size must be at least {ALIGN} bytes, got {size_bytes}")
        size_bytes = size_bytes // ALIGN * ALIGN
        if pin is None:
            pin = torch.cuda.is_available()
        start = time.monotonic()
        self.raw = torch.empty(size_bytes, dtype=torch.uint8)
        self.raw.zero_()  # fault every page in now, not on the serving path
        registered = pin and _register(self.raw)
        if pin and not registered:  # the slow way: the driver allocates and pins
            self.raw = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
            self.raw.zero_()
        # Unregistered by close() or, for an arena dropped without it, when it is collected:
        # never freed while registered (a later allocation at those addresses could not be
        # pinned: cudaErrorHostMemoryAlreadyRegistered, which SGLang's host pool then hit).
        self._unregister = weakref.finalize(self, _unregister, self.raw) if registered else None
        self.view = self.raw.numpy().data.cast("B")
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self.size = size_bytes
        self.pinned = pin
        self.lock = threading.RLock()
        self._free_offsets: list[int] = [0]
        self._free_sizes: dict[int, int] = {0: size_bytes}
        self._used: dict[int, int] = {}
        self._evictor: Callable[[int], int] | None = None
        logger.info("arena: %.2f GB %s in %.1fs", size_bytes / 1e9,
                    "pinned" if pin else "pageable", time.monotonic() - start)

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole arena as a 1-D tensor of `dtype` (cached)."""
        view = self._typed.get(dtype)
        if view is None:
            view = self._typed[dtype] = self.raw.view(dtype)
        return view

    def set_evictor(self, evictor: Callable[[int], int] | None) -> None:
        """`evictor(nbytes)` frees at least `nbytes` if it can and returns how many it freed."""
        self._evictor = evictor

    @property
    def used_bytes(self) -> int:
        with self.lock:
            return sum(self._used.values())

    def allocate(self, layout: KVLayout, num_tokens: int) -> MemoryObj | None:
        """A new object of `num_tokens` tokens (one reference, owned by the caller) or `None`."""
        need = _round_up(max(layout.nbytes(num_tokens), 1))
        if need > self.size:
            return None
        offset = self._take(need)
        if offset is None and self._evictor is not None:
            self._evictor(need)
            offset = self._take(need)
        if offset is None:
            return None
        return MemoryObj(self, offset, layout, num_tokens)

    def _take(self, need: int) -> int | None:
        with self.lock:
            for offset in self._free_offsets:
                size = self._free_sizes[offset]
                if size >= need:
                    break
            else:
                return None
            idx = bisect.bisect_left(self._free_offsets, offset)
            del self._free_offsets[idx]
            del self._free_sizes[offset]
            if size > need:
                self._free_offsets.insert(idx, offset + need)
                self._free_sizes[offset + need] = size - need
            self._used[offset] = need
            return offset

    def _free_locked(self, offset: int, nbytes: int) -> None:
        size = self._used.pop(offset)
        assert size == _round_up(max(nbytes, 1)), (offset, size, nbytes)
        idx = bisect.bisect_left(self._free_offsets, offset)
        # Coalesce with the next block, then with the previous one.
        nxt = offset + size
        if idx < len(self._free_offsets) and self._free_offsets[idx] == nxt:
            size += self._free_sizes.pop(nxt)
            del self._free_offsets[idx]
        if idx > 0:
            prev = self._free_offsets[idx - 1]
            if prev + self._free_sizes[prev] == offset:
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(idx, offset)
        self._free_sizes[offset] = size

    def check_integrity(self) -> None:
        """Raise `AssertionError` unless free and used blocks tile the arena exactly."""
        with self.lock:
            blocks = sorted([(o, s, "free") for o, s in self._free_sizes.items()]
                            + [(o, s, "used") for o, s in self._used.items()])
            assert self._free_offsets == sorted(self._free_sizes), "free list out of order"
            pos = 0
            prev_kind = ""
            for offset, size, kind in blocks:
                assert offset == pos, f"gap or overlap at {offset} (expected {pos})"
                assert size > 0 and size % ALIGN == 0, f"bad block size {size} at {offset}"
                assert not (kind == prev_kind == "free"), f"uncoalesced free blocks at {offset}"
                pos += size
                prev_kind = kind
            assert pos == self.size, f"blocks cover {pos} of {self.size} bytes"

    def close(self) -> None:
        if self._used:
            logger.warning("arena closed with %d objects still referenced", len(self._used))
        self._evictor = None
        if self._unregister is not None:
            self._unregister()  # once: a finalizer runs at most once


# cudaHostRegisterPortable | cudaHostRegisterMapped: every device may copy from and to it, and
# kernels may read and write it directly (the GPU copy kernels do).
_REGISTER_FLAGS = 1 | 2


def _unregister(raw: torch.Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(raw.data_ptr()))
    if err != 0:
        clear_cuda_error()
        logger.warning("arena: cudaHostUnregister failed (cudaError %d)", err)


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call whose code was handled.

    A failed runtime call (cudaHostRegister) leaves its code behind, and PyTorch reports it at
    the next kernel launch as if that kernel had failed. torch does not expose
    cudaGetLastError, so it is called in the runtime library torch loaded (found by path in
    this process's maps: the same copy, hence the same error state); best effort."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def _register(raw: torch.Tensor) -> bool:
    """Page-lock `raw` (already faulted in) for the GPUs; False if the driver refused.

    Pinning memory that is already faulted in is much faster than allocating pinned memory
    (measured on an H200 host, 16 GB: 1.8 s to fault in plus 1.1 s to register, against 6.4 s
    for `torch.empty(pin_memory=True)` and its first touch), and the arena is faulted in anyway.
    """
    err = int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), raw.numel(), _REGISTER_FLAGS))
    if err != 0:
        clear_cuda_error()
        logger.warning("arena: cudaHostRegister failed (cudaError %d); allocating pinned memory "
                       "instead (slower start-up)", err)
    return err == 0
