"""The engine on CUDA pools through its public API: round trips byte-exact for MHA and MLA,
partial chunks and skips, and the stream ordering (no host synchronisation on a load)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import KVConnector, SGLangMHAConnector, SGLangMLAConnector
from kvtier.engine import CacheEngine
from tests.gpu import cuda

pytestmark = cuda

SLOTS, CHUNK = 2048, 256
SPIN = 2_000_000_000  # GPU clock cycles: about a second of a busy stream


def mha(seed: int) -> SGLangMHAConnector:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = [torch.randn(SLOTS, 8, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
         for _ in range(4)]
    return SGLangMHAConnector(k, [torch.randn_like(t) for t in k])


def mla(seed: int) -> SGLangMLAConnector:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return SGLangMLAConnector([torch.randn(SLOTS, 1, 576, dtype=torch.bfloat16, device="cuda",
                                           generator=gen) for _ in range(5)])


@pytest.fixture(params=["mha-staged", "mha-mapped", "mla-staged", "mla-mapped"])
def pair(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
         ) -> Iterator[tuple[CacheEngine, CacheEngine]]:
    kind, path = request.param.split("-")
    monkeypatch.setenv("KVTIER_GPU_COPY", path)  # read when the engine is built
    make = mha if kind == "mha" else mla
    src, dst = make(1), make(2)
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.5, save_unfull_chunk=True)
    a = CacheEngine(cfg, model_name="m", layout=src.layout, connector=src)
    b = CacheEngine(cfg, model_name="m", layout=dst.layout, connector=dst, storage=a._storage)
    yield a, b
    b.close()
    a.close()


def rows(conn: KVConnector, slots: torch.Tensor) -> list[torch.Tensor]:
    return [layer[slots].view(torch.uint8) for layer in conn._layers]


def same_rows(a: KVConnector, sa: torch.Tensor, b: KVConnector, sb: torch.Tensor) -> bool:
    return all(torch.equal(x, y) for x, y in zip(rows(a, sa), rows(b, sb)))


def test_round_trip_is_byte_exact_with_a_partial_chunk(
        pair: tuple[CacheEngine, CacheEngine]) -> None:
    a, b = pair
    n = 3 * CHUNK + 100
    toks = torch.randint(0, 30000, (n,))
    src = torch.randperm(SLOTS, device="cuda")[:n]
    dst = torch.randperm(SLOTS, device="cuda")[:n]
    assert a.store(toks, src) == n
    assert b.retrieve(toks, dst) == n
    torch.cuda.synchronize()
    assert same_rows(a.connector, src, b.connector, dst)
    assert b._device is not None and b._device.drain(10)


def test_a_load_skips_the_rows_before_skip(pair: tuple[CacheEngine, CacheEngine]) -> None:
    a, b = pair
    n = 2 * CHUNK
    toks = torch.randint(0, 30000, (n,))
    src, dst = torch.arange(n, device="cuda"), torch.arange(n, 2 * n, device="cuda")
    a.store(toks, src)
    before = rows(b.connector, dst[:100])
    assert b.retrieve(toks, dst, skip=100) == n
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(rows(b.connector, dst[:100]), before))
    assert same_rows(a.connector, src[100:], b.connector, dst[100:])


def test_a_store_stops_at_the_first_chunk_with_an_unwritten_slot(
        pair: tuple[CacheEngine, CacheEngine]) -> None:
    a, _ = pair
    toks = torch.randint(0, 30000, (3 * CHUNK,))
    slots = torch.arange(3 * CHUNK, device="cuda")
    slots[CHUNK + 5] = -1
    assert a.store(toks, slots) == CHUNK


def test_a_store_with_out_of_range_slots_raises_and_stores_nothing(
        pair: tuple[CacheEngine, CacheEngine]) -> None:
    a, _ = pair
    toks = torch.randint(0, 30000, (2 * CHUNK,))
    slots = torch.arange(2 * CHUNK, device="cuda")
    slots[-1] = SLOTS
    with pytest.raises(ValueError, match="slot_mapping"):
        a.store(toks, slots)
    assert a.lookup(toks) == 0


def test_a_load_is_ordered_on_the_callers_stream_without_a_host_sync(
        pair: tuple[CacheEngine, CacheEngine]) -> None:
    a, b = pair
    n = 2 * CHUNK
    toks = torch.randint(0, 30000, (n,))
    src, dst = torch.arange(n, device="cuda"), torch.arange(n, 2 * n, device="cuda")
    a.store(toks, src)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)  # the forward before: the load must wait for it
    assert b.retrieve(toks, dst) == n
    assert not torch.cuda.current_stream().query()  # retrieve returned without waiting
    seen = [layer[dst].clone() for layer in b.connector._layers]  # the next forward's read
    torch.cuda.synchronize()
    want = rows(a.connector, src)
    assert all(torch.equal(x.view(torch.uint8), y) for x, y in zip(seen, want))


def test_a_store_reads_what_the_forward_wrote_before_it(
        pair: tuple[CacheEngine, CacheEngine]) -> None:
    a, b = pair
    n = CHUNK
    toks = torch.randint(0, 30000, (n,))
    src, dst = torch.arange(n, device="cuda"), torch.arange(n, device="cuda")
    torch.cuda._sleep(SPIN)
    for layer in a.connector._layers:  # the forward writes the KV after a busy second
        layer[src] = 7
    ready = torch.cuda.Event()
    ready.record()
    assert a.store(toks, src, ready=ready) == n
    b.retrieve(toks, dst)
    torch.cuda.synchronize()
    assert all(bool((layer[dst] == 7).all()) for layer in b.connector._layers)


def test_loads_release_their_arena_objects_once_copied(
        pair: tuple[CacheEngine, CacheEngine]) -> None:
    a, b = pair
    n = 4 * CHUNK
    toks = torch.randint(0, 30000, (n,))
    a.store(toks, torch.arange(n, device="cuda"))
    for _ in range(3):
        b.retrieve(toks, torch.arange(n, 2 * n, device="cuda"))
    assert b._device is not None and b._device.drain(10)
    held = a.stats()["arena_used_bytes"]
    assert held == a.stats()["cpu.bytes"]
    a._storage.allocator.check_integrity()
