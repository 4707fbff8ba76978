from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.memory import ALIGN, KVLayout, MemoryAllocator, MemoryFormat, lease
from tests.helpers import run_threads

LAYOUT = KVLayout.mha(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.float16)  # 128 B/tok


def test_layouts() -> None:
    mha = KVLayout.mha(32, 8, 128, torch.bfloat16)
    assert mha.shape(256) == (2, 32, 256, 1024) and mha.nbytes(256) == 32 * 2**20
    mla = KVLayout.mla(61, 576, torch.bfloat16)
    assert mla.fmt is MemoryFormat.KV_MLA and mla.shape(4) == (1, 61, 4, 576)
    assert mha.fingerprint(256) != KVLayout.mha(32, 8, 128, torch.float16).fingerprint(256)
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout.mha(0, 8, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout.mha(1, 8, 128, torch.complex64)


def test_objects_are_views_into_the_arena() -> None:
    alloc = MemoryAllocator(1 << 20)
    obj = alloc.allocate(LAYOUT, 32)
    assert obj is not None
    obj.tensor.fill_(1.5)
    assert obj.tensor.untyped_storage().data_ptr() == alloc.raw.untyped_storage().data_ptr()
    view = obj.byte_view()
    assert len(view) == obj.nbytes and not view.readonly
    view[:2] = b"\x00\x00"
    assert obj.tensor.view(-1)[0].item() == 0.0
    obj.release()
    alloc.check_integrity()
    assert alloc.used_bytes == 0


def test_full_arena_fails_fast_after_asking_the_evictor() -> None:
    alloc = MemoryAllocator(4 * ALIGN)
    held = [alloc.allocate(LAYOUT, 32) for _ in range(4)]
    assert all(held)
    asked: list[int] = []

    def evictor(nbytes: int) -> int:
        asked.append(nbytes)
        held.pop().release()  # type: ignore[union-attr]
        return ALIGN

    alloc.set_evictor(evictor)
    assert alloc.allocate(LAYOUT, 32) is not None and asked == [ALIGN]
    alloc.set_evictor(lambda n: 0)
    assert alloc.allocate(LAYOUT, 32) is None
    assert alloc.allocate(LAYOUT, 10**9) is None


def test_double_release_is_an_error() -> None:
    alloc = MemoryAllocator(1 << 20)
    obj = alloc.allocate(LAYOUT, 1)
    assert obj is not None
    obj.release()
    with pytest.raises(RuntimeError):
        obj.release()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 200), st.integers(0, 1000)),
                max_size=60))
def test_random_allocate_free_never_overlaps(ops: list[tuple[bool, int, int]]) -> None:
    alloc = MemoryAllocator(64 * ALIGN)
    live = []
    for is_alloc, tokens, pick in ops:
        if is_alloc or not live:
            obj = alloc.allocate(LAYOUT, tokens)
            if obj is not None:
                live.append(obj)
        else:
            live.pop(pick % len(live)).release()
        alloc.check_integrity()
        spans = sorted((o.offset, o.offset + o.nbytes) for o in live)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    with lease(live):
        pass
    alloc.check_integrity()
    assert alloc.used_bytes == 0


def test_threads_allocate_and_free() -> None:
    alloc = MemoryAllocator(256 * ALIGN)

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(300):
            obj = alloc.allocate(LAYOUT, int(torch.randint(1, 64, (1,), generator=gen)))
            if obj is not None:
                obj.tensor.fill_(seed)
                assert bool((obj.tensor == seed).all())
                obj.release()

    run_threads(work, [(i,) for i in range(8)])
    alloc.check_integrity()
    assert alloc.used_bytes == 0
