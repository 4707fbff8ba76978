"""`KVConnector.check_slots`: the whole slot vector is validated up front, naming the argument."""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors import SGLangMHAConnector


def _conn() -> SGLangMHAConnector:
    bufs = [torch.zeros(64, 2, 8, dtype=torch.float16) for _ in range(2)]
    return SGLangMHAConnector(bufs, [b.clone() for b in bufs])


@pytest.mark.parametrize(("slots", "problem"), [
    (torch.arange(40)[::2], "contiguous"),
    (torch.arange(20, device="meta"), "meta"),
    (torch.arange(20, dtype=torch.int32), "int64"),
    (torch.arange(20).reshape(4, 5), "1-D"),
    (torch.tensor([0, 1, 64]), "out of range"),
    (torch.tensor([0, -2]), "out of range"),
])
def test_bad_slot_vectors_name_the_argument(slots: torch.Tensor, problem: str) -> None:
    with pytest.raises(ValueError, match="slot_mapping") as err:
        _conn().check_slots(slots, name="slot_mapping")
    assert problem in str(err.value)


def test_good_slot_vectors_pass_and_give_their_smallest_slot() -> None:
    conn = _conn()
    assert conn.check_slots(torch.tensor([5, -1, 63]), name="slot_mapping") == -1
    assert conn.check_slots(torch.tensor([7, 3, 63]), name="slot_mapping") == 3
    assert conn.check_slots(torch.empty(0, dtype=torch.int64), name="slot_mapping") == 0
    with pytest.raises(ValueError, match="out of range"):
        conn.check_slots(torch.tensor([0, -1]), name="slot_mapping", allow_skip=False)


def test_pool_layers_are_checked_once_when_the_tuple_is_made() -> None:
    from kvtier.kernels import ops

    good = [torch.zeros(8, 16, dtype=torch.float16) for _ in range(2)]
    with pytest.raises(ValueError, match=r"layers\[1\]"):
        ops.CheckedLayers([good[0], torch.zeros(8, 16, dtype=torch.float32)])
    layers = ops.CheckedLayers(good)
    chunk = torch.empty(2, 3, 16, dtype=torch.float16)
    ops.gather(layers, torch.tensor([5, 1, 7]), chunk)  # the checked tuple serves the kernels
    assert torch.equal(chunk, torch.stack([g[[5, 1, 7]] for g in good]))
    with pytest.raises(ValueError, match="slots"):  # the slots are still checked every call
        ops.gather(layers, torch.tensor([5, 1, 8]), chunk)


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_a_non_tensor_argument_is_named_even_where_the_kernel_checks(op: str) -> None:
    from kvtier.kernels import ops

    assert ops.prepare() != "torch"  # the compiled kernel, which checks tensors itself
    layers, slots = [torch.zeros(8, 4) for _ in range(2)], torch.tensor([0, 1])
    copy = ops.gather if op == "gather" else (lambda ls, s, c: ops.scatter(c, s, ls))
    with pytest.raises(ValueError, match="out|src"):
        copy(layers, slots, "junk")
    with pytest.raises(ValueError, match="slots"):
        copy(layers, [0, 1], torch.zeros(2, 2, 4))


def test_the_kernels_slot_bounds_agree_with_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.kernels import ops

    assert ops.prepare() != "torch"
    slots = torch.randint(-1, 64, (300,), generator=torch.Generator().manual_seed(3))
    assert ops.slot_bounds(slots) == tuple(torch.stack(torch.aminmax(slots)).tolist())
    for other in (torch.empty(0, dtype=torch.int64), torch.arange(4, dtype=torch.int32),
                  torch.arange(8)[::2], torch.arange(4, device="meta")):
        assert ops.slot_bounds(other) is None  # the caller uses torch for these
    conn = _conn()
    fast = conn.check_slots(slots, name="slot_mapping")
    monkeypatch.setattr(ops, "slot_bounds", lambda s: None)  # as without the compiled kernel
    assert conn.check_slots(slots, name="slot_mapping") == fast == int(slots.min())
    with pytest.raises(ValueError, match=r"values in \[0, 64\]"):
        conn.check_slots(torch.tensor([0, 64]), name="slot_mapping")
