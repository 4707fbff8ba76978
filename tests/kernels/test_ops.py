"""The gather/scatter kernels against the PyTorch reference, byte for byte, and their checks.

The compiled kernels are loaded unconditionally (built on first use, or the ahead-of-time
`kvtier._C`): a machine that cannot build them fails these tests instead of skipping.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvtier.background import copy_threads, lower_priority
from kvtier.errors import ConfigError
from kvtier.kernels import build, ops
from tests.helpers import same_bytes

_C = build.load()

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]


@pytest.fixture(autouse=True)
def _auto_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_KERNEL", raising=False)


def random_rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes viewed as `dtype` (NaN patterns included: copies must be bit-exact)."""
    gen = torch.Generator().manual_seed(seed)
    *lead, hidden = shape
    raw = torch.randint(0, 256, (*lead, hidden * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def make_pool(n: int, num_slots: int, hidden: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [random_rows((num_slots, hidden), dtype, seed=i) for i in range(n)]


def make_slots(kind: str, num_tokens: int, num_slots: int, unique: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens)
    if kind == "contiguous":
        return torch.arange(3, 3 + num_tokens, dtype=torch.int64)
    if unique:
        return torch.randperm(num_slots, generator=gen)[:num_tokens]
    return torch.randint(0, num_slots, (num_tokens,), generator=gen)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_extension_is_built_and_dispatched() -> None:
    cuda = torch.cuda.is_available()  # a GPU machine builds the CUDA kernels too
    assert _C.WITH_CUDA == cuda
    assert ops.kernel_name() == ("cuda" if cuda else "cpp")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_layers", [2, 5, 64])
@pytest.mark.parametrize("num_tokens", [1, 7, 256])
@pytest.mark.parametrize("hidden", [1, 33, 136])
@pytest.mark.parametrize("kind", ["random", "contiguous"])
def test_gather_and_scatter_match_reference(
    dtype: torch.dtype, num_layers: int, num_tokens: int, hidden: int, kind: str
) -> None:
    num_slots = num_tokens + 11
    layers = make_pool(num_layers, num_slots, hidden, dtype)
    slots = make_slots(kind, num_tokens, num_slots, unique=False)

    expected = torch.empty(num_layers, num_tokens, hidden, dtype=dtype)
    ops.reference_gather(layers, slots, expected)
    got = torch.zeros_like(expected)
    _C.gather(layers, slots, got)
    assert same_bytes(got, expected)
    assert same_bytes(expected, torch.stack([layer[slots] for layer in layers]))

    slots = make_slots(kind, num_tokens, num_slots, unique=True)  # scatter: one writer per row
    src = random_rows((num_layers, num_tokens, hidden), dtype, seed=99)
    want = [layer.clone() for layer in layers]
    ops.reference_scatter(src, slots, want)
    _C.scatter(src, slots, layers)
    assert all(same_bytes(a, b) for a, b in zip(layers, want, strict=True))
    assert all(same_bytes(layer[slots], src[i]) for i, layer in enumerate(layers))


@pytest.mark.parametrize("offset", [0, 4, 16, 20])
def test_gather_into_a_chunk_at_any_alignment(offset: int) -> None:
    """Rows of 128 bytes and more take streaming stores after a plain copy up to a 32-byte
    boundary, shorter ones plain copies; at any alignment they land the same bytes."""
    layers = make_pool(6, 40, 40, torch.float32)  # 160-byte rows
    slots = make_slots("random", 25, 40, unique=False)
    raw = torch.zeros(6 * 25 * 40 * 4 + offset, dtype=torch.uint8)
    chunk = raw[offset:].view(torch.float32).view(6, 25, 40)
    assert chunk.is_contiguous() and chunk.data_ptr() % 32 == offset % 32
    _C.gather(layers, slots, chunk)
    expected = torch.empty(6, 25, 40)
    ops.reference_gather(layers, slots, expected)
    assert same_bytes(chunk, expected)
    assert not raw[:offset].any()  # nothing written before the chunk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
def test_public_functions_round_trip_a_realistic_chunk(dtype: torch.dtype) -> None:
    layers = make_pool(64, 300, 1024, dtype)  # 32 layers x K and V, 8 heads x 128
    slots = make_slots("random", 256, 300, unique=True)
    chunk = torch.empty(64, 256, 1024, dtype=dtype)
    ops.gather(layers, slots, chunk)
    expected = torch.empty_like(chunk)
    ops.reference_gather(layers, slots, expected)
    assert same_bytes(chunk, expected)

    fresh = [torch.zeros_like(layer) for layer in layers]
    ops.scatter(chunk, slots, fresh)
    for layer, restored in zip(layers, fresh, strict=True):
        assert same_bytes(restored[slots], layer[slots])


@pytest.mark.parametrize("scatter", [_C.scatter, ops.scatter, ops.reference_scatter])
def test_scatter_leaves_skipped_slots_untouched(scatter: Callable[..., None]) -> None:
    layers = make_pool(6, 50, 24, torch.bfloat16)
    before = [layer.clone() for layer in layers]
    slots = torch.tensor([7, -1, 3, -1, -1, 40, 0, -1], dtype=torch.int64)
    src = random_rows((6, 8, 24), torch.bfloat16, seed=5)
    scatter(src, slots, layers)
    written = slots >= 0
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[slots[written]] = False
    for i, (layer, old) in enumerate(zip(layers, before, strict=True)):
        assert same_bytes(layer[slots[written]], src[i][written])
        assert same_bytes(layer[untouched], old[untouched])


def test_the_gil_is_released_while_a_kernel_copies() -> None:
    """Another Python thread runs during a copy (the storage writer, while a load scatters): a
    counter it bumps moves between the instants just before and just after some copy. Held
    GIL: it never could."""
    layers = make_pool(8, 4096, 1024, torch.bfloat16)
    slots, out = torch.randperm(4096)[:2048], torch.empty(8, 2048, 1024, dtype=torch.bfloat16)
    count, stop = [0], threading.Event()

    def bump() -> None:
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)  # hands the GIL back at once: this thread never holds the test up

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)  # this thread keeps the GIL unless a call lets it go
    thread = threading.Thread(target=bump)
    thread.start()
    try:
        moved = 0
        for _ in range(50):
            before = count[0]
            ops.check_result(_C.gather(layers, slots, out))
            moved += count[0] != before
            if moved:
                break
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert moved


def test_concurrent_calls_from_threads_are_correct() -> None:
    # The extension releases the GIL: a storage writer thread gathers while serving scatters.
    layers = make_pool(8, 600, 256, torch.bfloat16)
    slots = [make_slots("random", 64, 600, unique=True) for _ in range(4)]
    outs = [torch.empty(8, 64, 256, dtype=torch.bfloat16) for _ in slots]
    targets = [torch.zeros(600, 256, dtype=torch.bfloat16) for _ in range(8)]

    def gather_all() -> None:
        for _ in range(20):
            for s, out in zip(slots, outs, strict=True):
                ops.gather(layers, s, out)

    def scatter_all() -> None:
        for _ in range(20):
            ops.scatter(outs[0], slots[0], targets)

    ops.gather(layers, slots[0], outs[0])
    threads = [threading.Thread(target=gather_all), threading.Thread(target=scatter_all)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s, out in zip(slots, outs, strict=True):
        assert same_bytes(out, torch.stack([layer[s] for layer in layers]))
    for layer, target in zip(layers, targets, strict=True):
        assert same_bytes(target[slots[0]], layer[slots[0]])


def test_scatter_with_only_skipped_slots_writes_nothing() -> None:
    layers = make_pool(4, 10, 8, torch.float16)
    before = [layer.clone() for layer in layers]
    ops.scatter(random_rows((4, 3, 8), torch.float16, 1), torch.full((3,), -1), layers)
    assert all(same_bytes(a, b) for a, b in zip(layers, before, strict=True))


@pytest.mark.parametrize("api", ["ops", "_C"])
def test_empty_slots_are_a_no_op(api: str) -> None:
    layers = make_pool(2, 10, 8, torch.float32)
    before = [layer.clone() for layer in layers]
    none = torch.empty(0, dtype=torch.int64)
    _run("gather", api, layers, none, torch.empty(2, 0, 8))
    _run("scatter", api, layers, none, torch.empty(2, 0, 8))
    assert all(same_bytes(a, b) for a, b in zip(layers, before, strict=True))
    # ... while the same calls with one slot do write: the no-op is not a skipped call.
    _run("scatter", api, layers, torch.tensor([3]), torch.zeros(2, 1, 8))
    assert not same_bytes(layers[0], before[0]) and not layers[1][3].any()


def test_forced_reference_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_KERNEL", "torch")
    assert ops.kernel_name() == "torch"
    layers = make_pool(3, 20, 5, torch.bfloat16)
    slots = torch.tensor([4, 19, 4, 0])
    out = torch.empty(3, 4, 5, dtype=torch.bfloat16)
    ops.gather(layers, slots, out)
    assert same_bytes(out, torch.stack([layer[slots] for layer in layers]))
    monkeypatch.setenv("KVTIER_KERNEL", "fast")
    with pytest.raises(ConfigError, match="KVTIER_KERNEL"):
        ops.gather(layers, slots, out)


# --- bad input: ValueError naming the argument, nothing written ------------------------------

N, SLOTS, T, H = 3, 16, 4, 8


def good_args() -> Args:
    return (
        make_pool(N, SLOTS, H, torch.bfloat16),
        torch.tensor([1, 5, 0, 15]),
        torch.zeros(N, T, H, dtype=torch.bfloat16),
    )


Args = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]  # layers, slots, chunk


def _with(layers: list[torch.Tensor], i: int, layer: torch.Tensor) -> list[torch.Tensor]:
    return [*layers[:i], layer, *layers[i + 1 :]]


def _transposed() -> torch.Tensor:
    return torch.empty(H, SLOTS, dtype=torch.bfloat16).t()


# name -> (turn good arguments into bad ones, regex the error must match; {chunk} = out/src)
BAD: dict[str, tuple[Callable[..., Args], str]] = {
    "layer dtype": (lambda ls, s, c: (_with(ls, 1, ls[1].float()), s, c), r"layers\[1\]"),
    "layer shape": (lambda ls, s, c: (_with(ls, 2, ls[2][:-1]), s, c), r"layers\[2\]"),
    "layer contiguity": (lambda ls, s, c: (_with(ls, 0, _transposed()), s, c), r"layers\[0\]"),
    "layer device": (lambda ls, s, c: (_with(ls, 1, ls[1].to("meta")), s, c), r"layers\[1\]"),
    "chunk dtype": (lambda ls, s, c: (ls, s, c.half()), "{chunk}"),
    "chunk contiguity": (lambda ls, s, c: (ls, s, c.transpose(1, 2).contiguous().mT), "{chunk}"),
    "chunk shape": (lambda ls, s, c: (ls, s, c.new_zeros(N, T + 1, H)), "{chunk}"),
    "chunk layer count": (lambda ls, s, c: (ls[:2], s, c), "{chunk}"),
    "chunk device": (lambda ls, s, c: (ls, s, c.to("meta")), "{chunk}"),
    "slots dtype": (lambda ls, s, c: (ls, s.int(), c), "slots"),
    "slots dim": (lambda ls, s, c: (ls, s.view(2, 2), c), "slots"),
    "slot too big": (lambda ls, s, c: (ls, torch.tensor([1, 5, SLOTS, 2]), c), "slots"),
    "slot below -1": (lambda ls, s, c: (ls, torch.tensor([1, -2, 0, 2]), c), "slots"),
    "slots device": (lambda ls, s, c: (ls, s.to("meta"), c), "slots"),
    "slots contiguity": (lambda ls, s, c: (ls, s.repeat_interleave(2)[::2], c), "slots"),
}


def _run(
    op: str, api: str, layers: list[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor
) -> None:
    if api == "ops":
        ops.gather(layers, slots, chunk) if op == "gather" else ops.scatter(chunk, slots, layers)
    else:  # the kernel returns its error, as it does for ops
        ops.check_result(_C.gather(layers, slots, chunk) if op == "gather"
                         else _C.scatter(chunk, slots, layers))


@pytest.mark.parametrize("api", ["ops", "_C"])
@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_the_argument_and_writes_nothing(
    case: str, op: str, api: str
) -> None:
    mutate, pattern = BAD[case]
    layers, slots, chunk = mutate(*good_args())
    chunk_name = "out" if op == "gather" else "src"
    snapshot = [t.clone() for t in [*layers, chunk] if t.device.type == "cpu"]
    with pytest.raises(ValueError, match=pattern.format(chunk=chunk_name)):
        _run(op, api, layers, slots, chunk)
    after = [t for t in [*layers, chunk] if t.device.type == "cpu"]
    assert all(same_bytes(a, b) for a, b in zip(after, snapshot, strict=True))


def test_gather_rejects_the_skip_slot() -> None:
    layers, _, out = good_args()
    with pytest.raises(ValueError, match="slots"):
        ops.gather(layers, torch.tensor([1, -1, 0, 2]), out)
    kind, message = _C.gather(layers, torch.tensor([1, -1, 0, 2]), out)
    assert kind == "ValueError" and message.startswith("slots must be in [0, ")
    assert not out.any()


def test_the_kernels_return_their_errors_instead_of_raising() -> None:
    """An exception leaving a kernel call that released the GIL killed the process on the H100
    machine (torch 2.11+cu130), so the kernels return (exception name, message) instead."""
    layers, slots, out = good_args()
    assert _C.gather(layers, slots, out) == ("", "")
    assert _C.scatter(out, slots, layers) == ("", "")
    kind, message = _C.scatter(out[:1], slots, layers)
    assert kind == "ValueError" and message.startswith("src must have shape [")
    kind, message = _C.gather_chunks(layers, slots, [out, out])
    assert kind == "ValueError" and "tokens, slots has" in message
    with pytest.raises(RuntimeError, match="boom"):
        ops.check_result(("RuntimeError", "boom"))


def _threads_started_by_a_copy(background: bool) -> tuple[int, int]:
    """(copy_threads(), OS threads the process gained) for one large gather on a new thread."""
    layers = [torch.randn(4096, 512) for _ in range(4)]
    slots = torch.randperm(4096)
    out = torch.empty(4, 4096, 512)
    seen: list[tuple[int, int]] = []

    def worker() -> None:
        if background:
            lower_priority()
        before = len(os.listdir("/proc/self/task"))
        ops.gather(layers, slots, out)
        seen.append((copy_threads(), len(os.listdir("/proc/self/task")) - before))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert torch.equal(out, torch.stack([layer[slots] for layer in layers]))
    return seen[0]


def test_a_background_threads_copy_runs_on_that_thread_alone() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel may use two threads, as on a 2-core host
    try:
        assert _threads_started_by_a_copy(background=True) == (1, 0)
        # The check sees a team: the same copy on a serving thread starts one.
        limit, started = _threads_started_by_a_copy(background=False)
        assert limit == 0 and started >= 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("hidden, dtype", [(8, torch.float16), (33, torch.bfloat16),
                                           (576, torch.bfloat16)], ids=str)
def test_runs_of_adjacent_slots_match_reference(hidden: int, dtype: torch.dtype) -> None:
    """Adjacent slots copy as one piece, cut at 128 KiB: pages of 1-40 slots, a run longer than
    a piece, runs broken by -1 (scatter), rows of odd sizes (MLA's 576 too, in its
    [1, layers, tokens, dim] object); these scatters pass 1 MiB, so they stream."""
    gen = torch.Generator().manual_seed(hidden)
    long = (1 << 17) // (hidden * dtype.itemsize) + 3
    starts = torch.randperm(60, generator=gen) * 40 + long + 8
    lengths = torch.randint(1, 41, (60,), generator=gen)
    slots = torch.cat([torch.arange(5, 5 + long), *map(torch.arange, starts, starts + lengths)])
    layers = make_pool(8, long + 8 + 60 * 40, hidden, dtype)
    expected = torch.empty(8, slots.numel(), hidden, dtype=dtype)
    ops.reference_gather(layers, slots, expected)
    got = torch.empty(1, *expected.shape, dtype=dtype)[0]
    _C.gather(layers, slots, got)
    assert same_bytes(got, expected)
    slots[torch.randperm(slots.numel(), generator=gen)[:50]] = -1
    want = [layer.clone() for layer in layers]
    ops.reference_scatter(expected.flip(0), slots, want)
    _C.scatter(expected.flip(0).contiguous(), slots, layers)
    assert all(same_bytes(a, b) for a, b in zip(layers, want, strict=True))
