from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector, SGLangMLAConnector
from kvtier.connectors.base import KVConnector
from kvtier.engine import CacheEngine
from kvtier.memory import KVLayout
from tests.helpers import run_threads, same_bytes

SLOTS = 512
CHUNK = 16


def _mha_pool(dtype: torch.dtype, layers: int = 3, heads: int = 2, dim: int = 8,
              seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)

    def buf() -> torch.Tensor:
        raw = torch.randint(0, 256, (SLOTS, heads, dim * dtype.itemsize), dtype=torch.uint8,
                            generator=gen)
        return raw.view(dtype) if seed >= 0 else torch.zeros(SLOTS, heads, dim, dtype=dtype)

    return [buf() for _ in range(layers)], [buf() for _ in range(layers)]


def _zeros_like(bufs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(b) for b in bufs]


def _mla_pool(dtype: torch.dtype, layers: int = 3, dim: int = 24) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (SLOTS, 1, dim * dtype.itemsize), dtype=torch.uint8,
                          generator=gen).view(dtype) for _ in range(layers)]


def _config(**kw: object) -> Config:
    # Whole chunks here; tails have their own tests (tests/storage/test_tails.py).
    args: dict = {"chunk_size": CHUNK, "max_local_cpu_size": 0.016, "save_tails": False}
    args.update(kw)
    return Config(**args)


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 30_000, (70,), generator=torch.Generator().manual_seed(3))


def _slots(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    if kind == "contiguous":
        return torch.arange(1, n + 1, dtype=torch.int64)
    return torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed))[:n]


def _pool_rows(conn_bufs: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    return [b[slots] for b in conn_bufs]


def _engines(src: KVConnector, dst: KVConnector,
             cfg: Config) -> tuple[CacheEngine, CacheEngine]:
    """Two engines over one storage manager (the first owns it), as two servers would be."""
    a = CacheEngine(cfg, model_name="m", layout=src.layout, connector=src)
    return a, CacheEngine(cfg, model_name="m", layout=dst.layout, connector=dst,
                          storage=a._storage)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("slot_kind", ["random", "contiguous"])
@pytest.mark.parametrize("unfull", [True, False])
def test_mha_round_trip_byte_exact(dtype: torch.dtype, slot_kind: str, unfull: bool,
                                   tokens: torch.Tensor) -> None:
    k, v = _mha_pool(dtype)
    k2, v2 = _zeros_like(k), _zeros_like(v)
    src, dst = SGLangMHAConnector(k, v), SGLangMHAConnector(k2, v2)
    slots_a = _slots(slot_kind, 70, seed=1)
    slots_b = _slots(slot_kind, 70, seed=2) if slot_kind == "random" else slots_a
    cfg = _config(save_unfull_chunk=unfull)
    a, b = _engines(src, dst, cfg)
    expect = 70 if unfull else 64
    assert a.store(tokens, slots_a) == expect
    assert a.store(tokens, slots_a) == 0  # already cached
    assert b.lookup(tokens) == expect
    assert b.retrieve(tokens, slots_b) == expect
    for src_bufs, dst_bufs in ((k, k2), (v, v2)):
        for s, d in zip(src_bufs, dst_bufs):
            assert same_bytes(s[slots_a[:expect]], d[slots_b[:expect]])
            untouched = torch.ones(SLOTS, dtype=torch.bool)
            untouched[slots_b[:expect]] = False
            assert not d[untouched].view(torch.uint8).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_mla_round_trip_byte_exact(dtype: torch.dtype, tokens: torch.Tensor) -> None:
    kv = _mla_pool(dtype)
    kv2 = _zeros_like(kv)
    src, dst = SGLangMLAConnector(kv), SGLangMLAConnector(kv2)
    slots_a, slots_b = _slots("random", 70, 4), _slots("random", 70, 5)
    a, b = _engines(src, dst, _config())
    assert a.store(tokens, slots_a) == 64
    assert b.retrieve(tokens, slots_b) == 64
    for s, d in zip(kv, kv2):
        assert same_bytes(s[slots_a[:64]], d[slots_b[:64]])


def test_mla_keys_ignore_rank_and_only_rank0_writes_to_shared_tiers(
        tokens: torch.Tensor, tmp_path: Path) -> None:
    kv = _mla_pool(torch.bfloat16)
    conn = SGLangMLAConnector(kv)
    slots = _slots("random", 70)
    cfg = _config(local_disk=str(tmp_path / "kv"), max_local_disk_size=0.01)
    mla = {"model_name": "m", "layout": conn.layout, "connector": conn, "world_size": 2}
    with CacheEngine(cfg, rank=1, **mla) as r1:
        # its own CPU tier holds it (a CPU-only rank 1 hits too), its disk gets nothing
        assert r1.store(tokens, slots) == 64 and r1.lookup(tokens) == 64
        assert r1.flush(30)
        assert not list((tmp_path / "kv").rglob("*.kv*"))
        with CacheEngine(cfg, rank=0, **mla) as r0:  # its own process: storage of its own
            assert r0.lookup(tokens) == 0
            assert r0.store(tokens, slots) == 64
            assert r0.flush(30)
        assert list((tmp_path / "kv").rglob("*.kv*"))
        fresh = CacheEngine(cfg, rank=1, **mla)
        try:  # a restarted rank 1 loads what rank 0 wrote down
            assert fresh.lookup(tokens) == 64
        finally:
            fresh.close()


def test_mha_ranks_are_keyed_apart(tokens: torch.Tensor) -> None:
    k, v = _mha_pool(torch.bfloat16)
    conn = SGLangMHAConnector(k, v)
    slots = _slots("random", 70)
    with CacheEngine(_config(), model_name="m", layout=conn.layout, connector=conn,
                     world_size=2, rank=0) as r0:
        r1 = CacheEngine(_config(), model_name="m", layout=conn.layout, connector=conn,
                         world_size=2, rank=1, storage=r0._storage)
        assert r0.store(tokens, slots) == 64
        assert r1.lookup(tokens) == 0


def test_skip_and_minus_one_slots_are_not_written(tokens: torch.Tensor) -> None:
    k, v = _mha_pool(torch.float16)
    src = SGLangMHAConnector(k, v)
    k2, v2 = _zeros_like(k), _zeros_like(v)
    dst = SGLangMHAConnector(k2, v2)
    slots = _slots("random", 70)
    a, b = _engines(src, dst, _config())
    a.store(tokens, slots)
    target = slots.clone()
    target[40] = -1
    assert b.retrieve(tokens, target, skip=20) == 64
    for s, d in zip(k + v, k2 + v2):
        assert not d[slots[:20]].view(torch.uint8).any()  # skipped
        assert not d[slots[40]].view(torch.uint8).any()  # -1
        assert same_bytes(s[slots[20:40]], d[slots[20:40]])
        assert same_bytes(s[slots[41:64]], d[slots[41:64]])
    assert b.retrieve(tokens, target, skip=64) == 64
    assert b.retrieve(tokens, target, skip=70) == 70


def test_retrieve_stops_at_first_missing_chunk(tokens: torch.Tensor) -> None:
    k, v = _mha_pool(torch.float16)
    conn = SGLangMHAConnector(k, v)
    slots = _slots("random", 70)
    with CacheEngine(_config(), model_name="m", layout=conn.layout, connector=conn) as eng:
        eng.store(tokens[:32], slots[:32])
        assert eng.lookup(tokens) == 32
        assert eng.retrieve(tokens, slots) == 32
        eng.tiers.remove(eng.chunk_keys(tokens)[:1])
        assert eng.lookup(tokens) == 0
        assert eng.retrieve(tokens, slots) == 0


def test_store_stops_at_chunk_with_unknown_slot(tokens: torch.Tensor) -> None:
    k, v = _mha_pool(torch.float16)
    conn = SGLangMHAConnector(k, v)
    slots = _slots("random", 70)
    slots[20] = -1
    with CacheEngine(_config(), model_name="m", layout=conn.layout, connector=conn) as eng:
        assert eng.store(tokens, slots) == 16
        assert eng.lookup(tokens) == 16


@pytest.mark.parametrize(
    ("tokens_arg", "slots_arg", "match"),
    [
        (torch.zeros(2, 35, dtype=torch.long), torch.arange(70), "token_ids"),
        (list(range(70)), torch.arange(70, dtype=torch.int32), "slot_mapping"),
        (list(range(70)), torch.arange(69), "slot_mapping"),
        (list(range(70)), torch.arange(70).reshape(7, 10), "slot_mapping"),
        (list(range(70)), torch.arange(70) + SLOTS, "slot_mapping"),
        (list(range(70)), torch.arange(70) - 2, "slot_mapping"),
        (list(range(70)), torch.arange(70).float(), "slot_mapping"),
        (list(range(70)), torch.arange(70, device="meta"), "slot_mapping"),
        (list(range(70)), torch.arange(140)[::2], "slot_mapping"),
        (torch.arange(70, device="meta"), torch.arange(70), "token_ids"),
    ],
)
def test_bad_input_raises_and_changes_nothing(tokens_arg: object, slots_arg: torch.Tensor,
                                              match: str) -> None:
    k, v = _mha_pool(torch.float16)
    before = [b.clone() for b in k + v]
    conn = SGLangMHAConnector(k, v)
    with CacheEngine(_config(), model_name="m", layout=conn.layout, connector=conn) as eng:
        for call in (eng.store, eng.retrieve):
            with pytest.raises(ValueError, match=match):
                call(tokens_arg, slots_arg)  # type: ignore[operator]
        assert eng.stats()["cpu.entries"] == 0
        with pytest.raises(ValueError, match="skip"):
            eng.retrieve(list(range(70)), torch.arange(70), skip=71)
    assert all(same_bytes(a, b) for a, b in zip(before, k + v))


def test_bad_pools_and_layout_mismatch() -> None:
    k, v = _mha_pool(torch.float16)
    with pytest.raises(ValueError, match="v_buffers"):
        SGLangMHAConnector(k, [torch.zeros(SLOTS, 2, 4, dtype=torch.float16)] * 3)
    with pytest.raises(ValueError, match="v_buffers"):
        SGLangMHAConnector(k, v[:2])
    with pytest.raises(ValueError, match="k_buffers"):
        SGLangMHAConnector([k[0], k[1].float(), k[2]], v)
    with pytest.raises(ValueError, match="kv_buffers"):
        SGLangMLAConnector([torch.zeros(SLOTS, 2, 8)])
    conn = SGLangMHAConnector(k, v)
    wrong = KVLayout.mha(3, 2, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="layout"):
        CacheEngine(_config(), model_name="m", layout=wrong, connector=conn)


def test_fp8_pool_stored_as_uint8_round_trips() -> None:
    gen = torch.Generator().manual_seed(9)
    k = [torch.randint(0, 256, (SLOTS, 2, 8), dtype=torch.uint8, generator=gen)
         .view(torch.float8_e4m3fn) for _ in range(2)]
    v = [b.clone() for b in k]
    conn = SGLangMHAConnector(k, v)
    k2, v2 = _zeros_like(k), _zeros_like(v)
    dst = SGLangMHAConnector(k2, v2)
    tokens = list(range(32))
    slots = _slots("random", 32)
    a, b = _engines(conn, dst, _config())
    a.store(tokens, slots)
    assert b.retrieve(tokens, slots) == 32
    assert all(same_bytes(x[slots], y[slots]) for x, y in zip(k + v, k2 + v2))


def test_eviction_keeps_prefixes_usable() -> None:
    # Arena of ~100 chunks; store 30 prompts of 8 chunks each.
    k, v = _mha_pool(torch.float32, layers=4, heads=2, dim=32)
    conn = SGLangMHAConnector(k, v)
    chunk_bytes = conn.layout.nbytes(CHUNK)
    cfg = _config(max_local_cpu_size=100 * chunk_bytes / 1e9)
    gen = torch.Generator().manual_seed(0)
    with CacheEngine(cfg, model_name="m", layout=conn.layout, connector=conn) as eng:
        prompts = [torch.randint(0, 30_000, (128,), generator=gen) for _ in range(30)]
        slots = _slots("random", 128)
        for p in prompts:
            eng.store(p, slots)
        hits = [eng.lookup(p) for p in prompts]
        assert sum(hits) > 0 and hits[-1] == 128
        assert eng.stats()["cpu_evictions"] > 0
        for p, hit in zip(prompts, hits):
            # What is left of each prompt is a prefix: exactly the chunks before `hit`.
            keys = eng.chunk_keys(p)
            present = [eng._storage.hot.batch_contains([key]) for key in keys]
            assert present == [1] * (hit // CHUNK) + [0] * (len(keys) - hit // CHUNK)
        eng._storage.allocator.check_integrity()


def test_eight_threads_overlapping_prompts() -> None:
    k, v = _mha_pool(torch.bfloat16, layers=2)
    src = SGLangMHAConnector(k, v)
    base = torch.randint(0, 30_000, (64,), generator=torch.Generator().manual_seed(1))
    chunk_bytes = src.layout.nbytes(CHUNK)
    cfg = _config(max_local_cpu_size=40 * chunk_bytes / 1e9)
    engine = CacheEngine(cfg, model_name="m", layout=src.layout, connector=src)

    def work(i: int) -> None:
        k2, v2 = _zeros_like(k), _zeros_like(v)
        dst = SGLangMHAConnector(k2, v2)
        mine = CacheEngine(cfg, model_name="m", layout=dst.layout, connector=dst,
                           storage=engine._storage)
        gen = torch.Generator().manual_seed(100 + i)
        for _ in range(25):
            tail = torch.randint(0, 30_000, (32,), generator=gen)
            prompt = torch.cat([base, tail])
            # Same tokens must mean same KV: the shared prefix lives in the same source rows.
            tail_slots = 65 + torch.randperm(SLOTS - 65, generator=gen)[:32]
            slots = torch.cat([torch.arange(1, 65), tail_slots])
            engine.store(prompt, slots)
            got = mine.retrieve(prompt, slots)
            assert got % CHUNK == 0
            for s, d in zip(k + v, k2 + v2):
                assert same_bytes(s[slots[:got]], d[slots[:got]])

    run_threads(work, [(i,) for i in range(8)])
    alloc = engine._storage.allocator
    engine.close()
    alloc.check_integrity()
    assert alloc.used_bytes == 0


def test_connector_rejects_bad_slots_without_writing() -> None:
    k, v = _mha_pool(torch.float16)
    conn = SGLangMHAConnector(k, v)
    before = [b.clone() for b in k + v]
    with CacheEngine(_config(), model_name="m", layout=conn.layout, connector=conn) as eng:
        obj = eng._storage.allocator.allocate(conn.layout, 4)
        assert obj is not None
        try:
            for bad in (torch.tensor([0, 1, 2, SLOTS]), torch.tensor([0, 1, -1, 2]),
                        [0, 1, 2, 3]):
                with pytest.raises(ValueError, match="slots"):
                    conn.gather(bad, obj)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="slots"):
                conn.scatter(obj, torch.tensor([0, 1, -2, 3]))
            with pytest.raises(ValueError, match="obj"):
                conn.scatter(obj, torch.tensor([0, 1, 2]))
        finally:
            obj.release()
    assert all(same_bytes(a, b) for a, b in zip(before, k + v))


@pytest.mark.parametrize("bad", ["non_contiguous", "out_of_range_late", "meta_tokens"])
def test_retrieve_failing_argument_checks_writes_no_pool_row(tokens: torch.Tensor,
                                                             bad: str) -> None:
    # Every chunk is cached, so a retrieve that checked lazily would write the first chunks
    # before meeting the bad part of its arguments.
    k, v = _mha_pool(torch.float16)
    src = SGLangMHAConnector(k, v)
    k2, v2 = _zeros_like(k), _zeros_like(v)
    dst = SGLangMHAConnector(k2, v2)
    a, b = _engines(src, dst, _config())
    slots = _slots("random", 70)
    assert a.store(tokens, slots) == 64
    token_arg: object = tokens
    if bad == "non_contiguous":
        target = torch.stack([slots, slots]).t().reshape(-1)[::2]  # same values, stride 2
        assert not target.is_contiguous()
    elif bad == "out_of_range_late":
        target = slots.clone()
        target[60] = SLOTS + 5
    else:
        target, token_arg = slots, tokens.to("meta")
    name = "token_ids" if bad == "meta_tokens" else "slot_mapping"
    with pytest.raises(ValueError, match=name):
        b.retrieve(token_arg, target, skip=5)  # type: ignore[arg-type]
    assert all(not d.view(torch.uint8).any() for d in k2 + v2)  # no pool row changed
    a.close()


def test_a_chunk_the_lower_tier_holds_is_not_written_again(tmp_path: Path,
                                                            tokens: torch.Tensor) -> None:
    k, v = _mha_pool(torch.float16)
    conn = SGLangMHAConnector(k, v)
    cfg = _config(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1)
    with CacheEngine(cfg, model_name="m", layout=conn.layout, connector=conn) as engine:
        slots = _slots("contiguous", len(tokens))
        assert engine.store(tokens, slots) == 64 and engine.flush()
        written = engine.stats()["disk.writes"]
        engine.tiers.remove(engine.chunk_keys(tokens), "cpu")  # the CPU tier forgot them
        assert engine.store(tokens, slots) == 64  # back in the CPU tier ...
        assert engine.flush()
        stats = engine.stats()
        assert stats["disk.writes"] == written  # ... but not rewritten to disk
        assert stats["disk.write_present"] == 4


def test_a_prefetch_of_what_the_cpu_tier_holds_is_done_at_once(tokens: torch.Tensor) -> None:
    k, v = _mha_pool(torch.float16)
    conn = SGLangMHAConnector(k, v)
    with CacheEngine(_config(), model_name="m", layout=conn.layout, connector=conn) as eng:
        slots = _slots("contiguous", len(tokens))
        assert eng.store(tokens, slots) == len(tokens) // CHUNK * CHUNK
        held = eng.start_prefetch(tokens, limit=2 * CHUNK)
        assert held.done() and not held.keys  # nothing to load: no prefetch round at all
        assert eng.stats().get("prefetches", 0) == 0
        missing = eng.start_prefetch(torch.arange(1, 1 + 2 * CHUNK))
        assert list(missing.keys)  # not held: a real prefetch
        missing.cancel()

