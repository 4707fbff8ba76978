"""`gather_chunks`/`scatter_chunks`: many chunks in one call (a whole prompt's store or load),
byte for byte against one reference copy per chunk, and checked before anything is written."""

from __future__ import annotations

import pytest
import torch

from kvtier.kernels import build, ops
from tests.helpers import same_bytes
from tests.kernels.test_ops import make_pool, random_rows

_C = build.load()


def _one_by_one(op: str, chunks: list[torch.Tensor], slots: torch.Tensor,
                layers: list[torch.Tensor]) -> None:
    for chunk, rows in zip(chunks, slots.split([c.shape[1] for c in chunks]), strict=True):
        if op == "gather":
            ops.reference_gather(layers, rows, chunk)
        else:
            ops.reference_scatter(chunk, rows, layers)


def _copy(op: str, chunks: list[torch.Tensor], slots: torch.Tensor,
          layers: list[torch.Tensor], direct: bool = False) -> None:
    if op == "gather":
        (_C.gather_chunks if direct else ops.gather_chunks)(layers, slots, chunks)
    else:
        (_C.scatter_chunks if direct else ops.scatter_chunks)(chunks, slots, layers)


@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_chunks_equal_one_copy_per_chunk(op: str, kernel: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_KERNEL", kernel)
    sizes = [16, 0, 16, 5, 16, 0]  # empty chunks share a start row with the next one
    chunks = [random_rows((3, t, 8), torch.bfloat16, seed=10 + i) for i, t in enumerate(sizes)]
    slots = torch.randperm(100)[: sum(sizes)] + 1
    if op == "scatter":
        slots[3] = -1  # a row left alone
    batched, one_by_one = make_pool(3, 101, 8, torch.bfloat16), make_pool(3, 101, 8,
                                                                          torch.bfloat16)
    expected = [c.clone() for c in chunks]
    _copy(op, chunks, slots, batched)
    _one_by_one(op, expected, slots, one_by_one)
    assert all(same_bytes(a, b) for a, b in zip(batched, one_by_one, strict=True))
    assert all(same_bytes(a, b) for a, b in zip(chunks, expected, strict=True))


@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("case, pattern", [
    ("tokens", "hold 21 tokens, slots has 20"),
    ("chunk shape", r"s\[1\]"),
    ("chunk dtype", r"s\[1\]"),
    ("slot range", "slots"),
    ("empty", "must be a non-empty"),
])
def test_chunks_reject_bad_input_before_writing(
        op: str, kernel: str, case: str, pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_KERNEL", kernel)
    layers = make_pool(2, 30, 4, torch.float32)
    chunks = [random_rows((2, 16, 4), torch.float32, 1), random_rows((2, 4, 4), torch.float32, 2)]
    slots = torch.arange(1, 21)
    if case == "tokens":
        chunks[1] = random_rows((2, 5, 4), torch.float32, 2)
    elif case == "chunk shape":
        chunks[1] = random_rows((3, 4, 4), torch.float32, 2)
    elif case == "chunk dtype":
        chunks[1] = chunks[1].double()
    elif case == "slot range":
        slots[-1] = 30
    else:
        chunks = []
    before = [t.clone() for t in layers + chunks]
    with pytest.raises(ValueError, match=pattern):
        _copy(op, chunks, slots, layers)
    assert all(same_bytes(a, b) for a, b in zip(layers + chunks, before, strict=True))


def test_a_gather_takes_no_skipped_slot() -> None:
    layers = make_pool(2, 30, 4, torch.float32)
    outs = [torch.zeros(2, 3, 4)]
    with pytest.raises(ValueError, match="slots"):
        ops.gather_chunks(layers, torch.tensor([1, -1, 2]), outs)
    assert not outs[0].any()


@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("hidden", [24, 4096])  # 4096: 1 MiB, so a scatter streams
def test_a_run_of_slots_ends_with_its_chunk(op: str, hidden: int) -> None:
    """Slots running on across chunks are adjacent in the pool but not in memory."""
    sizes = [7, 0, 9, 1, 16]  # an empty chunk between two, a -1 ending chunk 0 (scatter)
    chunks = [random_rows((4, t, hidden), torch.bfloat16, seed=20 + i)
              for i, t in enumerate(sizes)]
    slots = torch.arange(10, 10 + sum(sizes))
    if op == "scatter":
        slots[6] = -1
    batched, one_by_one = (make_pool(4, 60, hidden, torch.bfloat16) for _ in range(2))
    expected = [c.clone() for c in chunks]
    _copy(op, chunks, slots, batched, direct=True)
    _one_by_one(op, expected, slots, one_by_one)
    assert all(same_bytes(a, b) for a, b in zip(batched, one_by_one, strict=True))
    assert all(same_bytes(a, b) for a, b in zip(chunks, expected, strict=True))
