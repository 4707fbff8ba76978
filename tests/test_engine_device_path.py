"""The engine's GPU path (`PrefixSaver._save_on_gpu`, the one-copy loads and their held
objects) run on CPU pools: a stand-in for `DeviceCopies` does the copies with the sync-free
reference and holds each load's objects until the test fires its event, as a CUDA event would.
tests/gpu/ runs the same paths on real CUDA streams."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import KVConnector, SGLangMHAConnector, SGLangMLAConnector
from kvtier.connectors.streams import Fence
from kvtier.engine import CacheEngine
from kvtier.kernels.host_copy import reference_gather_host, reference_scatter_host
from kvtier.memory import ALIGN, MemoryObj
from tests.connectors.test_streams import FakeEvent

CHUNK, SLOTS = 16, 256


class CopiesOnCPU:
    """`DeviceCopies`' contract on CPU tensors; loads finish when `fire()` says so."""

    def __init__(self, connector: KVConnector):
        self.connector = connector
        self.fence = Fence(name="kv-test-fence")
        self.pending: list[FakeEvent] = []
        self.gathers = 0

    def gather(self, runs: Sequence[torch.Tensor], objs: Sequence[MemoryObj],
               ready: object = None) -> list[int]:
        self.gathers += 1
        status = torch.zeros(len(objs), dtype=torch.int32)
        reference_gather_host(self.connector._layers, torch.cat(list(runs)),
                              self.connector._planes(objs, "objs"), status)
        return status.tolist()

    def scatter(self, objs: Sequence[MemoryObj], slots: torch.Tensor) -> None:
        status = torch.zeros(len(objs), dtype=torch.int32)
        reference_scatter_host(self.connector._planes(objs, "objs"), slots,
                               self.connector._layers, status)
        held = [obj.retain() for obj in objs]
        event = FakeEvent()
        self.pending.append(event)
        self.fence.defer(event, lambda: [obj.release() for obj in held])

    def fire(self) -> None:
        for event in self.pending:
            event.fire()
        self.pending.clear()
        assert self.fence.drain(5)

    def close(self, timeout: float = 1.0) -> None:
        self.fire()
        self.fence.close()


def mha(seed: int) -> KVConnector:
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(SLOTS, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(3)]
    return SGLangMHAConnector(k, [t.clone().add_(1) for t in k])


def mla(seed: int) -> KVConnector:
    gen = torch.Generator().manual_seed(seed)
    return SGLangMLAConnector([torch.randn(SLOTS, 1, 24, generator=gen).to(torch.float16)
                               for _ in range(2)])


@pytest.fixture(params=["mha", "mla"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[CacheEngine, CacheEngine]]:
    make = mha if request.param == "mha" else mla
    src, dst = make(1), make(2)
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.01, save_unfull_chunk=True)
    a = CacheEngine(cfg, model_name="m", layout=src.layout, connector=src)
    b = CacheEngine(cfg, model_name="m", layout=dst.layout, connector=dst, storage=a._storage)
    for engine, conn in ((a, src), (b, dst)):  # what a CUDA pool would get
        engine._device = engine._saver._device = engine._loader._device = \
            CopiesOnCPU(conn)  # type: ignore[assignment]
    yield a, b
    b.close()
    a.close()


def rows(conn: KVConnector, slots: torch.Tensor) -> list[torch.Tensor]:
    return [layer[slots].view(torch.uint8) for layer in conn._layers]


def test_round_trip_through_the_device_path(engines: tuple[CacheEngine, CacheEngine]) -> None:
    a, b = engines
    n = 3 * CHUNK + 5
    toks = torch.randint(0, 30000, (n,))
    src, dst = torch.randperm(SLOTS)[:n], torch.randperm(SLOTS)[:n]
    assert a.store(toks, src) == n
    assert a._device.gathers == 1  # type: ignore[union-attr]  # one copy for all chunks
    assert a.store(toks, src) == 0  # held already: nothing copied
    assert b.retrieve(toks, dst, skip=3) == n
    assert all(torch.equal(x, y) for x, y in zip(rows(a.connector, src[3:]),
                                                 rows(b.connector, dst[3:])))


def test_a_load_holds_its_objects_until_the_copy_has_run(
        engines: tuple[CacheEngine, CacheEngine]) -> None:
    a, b = engines
    n = 4 * CHUNK
    toks = torch.randint(0, 30000, (n,))
    a.store(toks, torch.arange(n))
    b.retrieve(toks, torch.arange(n, 2 * n))
    b.retrieve(toks, torch.arange(n, 2 * n), hot_only=True)
    objs = a._storage.hot.batch_get(a.chunk_keys(toks))
    try:
        assert [o.refs for o in objs] == [4] * 4  # tier + two loads in flight + this lease
        assert a._storage.hot.pop_lru(1 << 30) == []  # in use: never evicted under a copy
        b._device.fire()  # type: ignore[union-attr]
        assert [o.refs for o in objs] == [2] * 4
    finally:
        for obj in objs:
            obj.release()


def test_a_store_keeps_chunks_up_to_the_first_unwritten_slot(
        engines: tuple[CacheEngine, CacheEngine]) -> None:
    a, _ = engines
    toks = torch.randint(0, 30000, (3 * CHUNK,))
    slots = torch.arange(3 * CHUNK)
    slots[CHUNK + 2] = -1
    used = a.stats()["arena_used_bytes"]
    assert a.store(toks, slots) == CHUNK
    assert a.lookup(toks) == CHUNK
    chunk = -(-a.layout.nbytes(CHUNK) // ALIGN) * ALIGN
    assert a.stats()["arena_used_bytes"] == used + chunk  # the others were freed


def test_a_store_with_out_of_range_slots_raises_after_releasing_the_slots(
        engines: tuple[CacheEngine, CacheEngine]) -> None:
    a, _ = engines
    toks = torch.randint(0, 30000, (2 * CHUNK,))
    slots = torch.arange(2 * CHUNK)
    slots[-1] = SLOTS + 1
    read: list[bool] = []
    # CPU pools check the range up front; a CUDA pool learns it from the kernel, after the
    # copy: skip the up-front check the way a CUDA pool does.
    a.connector.check_slots = lambda *args, **kw: None  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="slot_mapping"):
        a.store(toks, slots, on_read=lambda: read.append(True))
    assert read == [True] and a.lookup(toks) == 0
    assert a.stats()["arena_used_bytes"] == 0


def test_the_inner_tail_is_stored_from_the_same_copy(
        engines: tuple[CacheEngine, CacheEngine]) -> None:
    a, b = engines
    n = 2 * CHUNK + 9
    toks = torch.randint(0, 30000, (n,))
    assert a.store(toks, torch.arange(n), also_prefix=2 * CHUNK + 4) == n
    assert a._device.gathers == 1  # type: ignore[union-attr]
    dst = torch.arange(SLOTS - n, SLOTS)
    assert b.retrieve(toks[:2 * CHUNK + 4], dst[:2 * CHUNK + 4]) == 2 * CHUNK + 4
    assert all(torch.equal(x, y) for x, y in zip(rows(a.connector, torch.arange(2 * CHUNK + 4)),
                                                 rows(b.connector, dst[:2 * CHUNK + 4])))
