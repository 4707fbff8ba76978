"""kvtier against SGLang's real KV pools and allocators, in process (no server).

Round trips through `CacheEngine` with the SGLang connectors must be byte-exact at page sizes
1, 4 and 16, for MHA and MLA pools, with slots handed out by SGLang's own allocators: on CPU
pools everywhere, and on CUDA pools where a GPU is present (skipped, with that reason, where
torch sees none).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier import CacheEngine
from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.integration.sglang.launch.identity import model_key_name
from kvtier.integration.sglang.rank.adapter import (
    FIRST_CHECK_WAIT_S,
    SGLangKVTier,
    build_connector,
    check_page_size,
)
from kvtier.storage.prefetch.handle import Prefetch
from tests.gpu import cuda
from tests.helpers import make_keys

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("sglang_parallel_context")]

POOL_TOKENS = 512
CHUNK = 16
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


def make_pool(kind: str, page_size: int, dtype: torch.dtype, device: str = "cpu") -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if kind == "mha":
        return MHATokenToKVPool(POOL_TOKENS, page_size=page_size, dtype=dtype, head_num=2,
                                head_dim=8, layer_num=3, device=device,
                                enable_memory_saver=False)
    return MLATokenToKVPool(POOL_TOKENS, page_size=page_size, dtype=dtype, kv_lora_rank=32,
                            qk_rope_head_dim=8, layer_num=2, device=device,
                            enable_memory_saver=False)


def make_allocator(pool: Any, page_size: int) -> Any:
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )

    device = str(pool.device)
    if page_size == 1:
        return TokenToKVPoolAllocator(POOL_TOKENS, dtype=pool.dtype, device=device,
                                      kvcache=pool, need_sort=False)
    return PagedTokenToKVPoolAllocator(POOL_TOKENS, page_size=page_size, dtype=pool.dtype,
                                       device=device, kvcache=pool, need_sort=False)


def buffers(pool: Any) -> list[torch.Tensor]:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return list(pool.kv_buffer) if isinstance(pool, MLATokenToKVPool) \
        else [*pool.k_buffer, *pool.v_buffer]


def fill(pool: Any, slots: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in buffers(pool):
        rows = buf[slots]
        raw = torch.randint(0, 256, rows.view(torch.uint8).shape, dtype=torch.uint8,
                            generator=gen)
        buf[slots] = raw.to(buf.device).view(buf.dtype).view(rows.shape)


def rows_bytes(pool: Any, slots: torch.Tensor) -> list[bytes]:
    """The rows' bytes, read on the current stream (on a GPU: after any load it waits for)."""
    return [buf[slots].contiguous().view(torch.uint8).cpu().numpy().tobytes()
            for buf in buffers(pool)]


@pytest.fixture
def engine_for() -> Iterator[Any]:
    engines: list[CacheEngine] = []

    def make(pool: Any, page_size: int = 1) -> CacheEngine:
        conn = build_connector(pool)
        engine = CacheEngine(Config(chunk_size=CHUNK, max_local_cpu_size=0.02),
                             model_name="pool-test", layout=conn.layout, connector=conn,
                             page_size=page_size)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kind,dtype", [("mha", torch.bfloat16), ("mla", torch.float32)])
def test_round_trip_is_byte_exact(engine_for: Any, kind: str, dtype: torch.dtype,
                                  page_size: int, device: str) -> None:
    pool = make_pool(kind, page_size, dtype, device)
    alloc = make_allocator(pool, page_size)
    engine = engine_for(pool, page_size)
    n = 4 * CHUNK + 5  # four whole chunks and a partial one: its whole pages are a tail
    stored = n - n % page_size
    tokens = torch.arange(100, 100 + n)
    src = alloc.alloc(n + (-n) % page_size)[:n].to(torch.int64)
    fill(pool, src, seed=page_size)
    expected = rows_bytes(pool, src[:stored])

    assert engine.store(tokens, src) == stored
    assert engine.lookup(tokens) == stored

    dst = alloc.alloc(stored + (-stored) % page_size)[:stored].to(torch.int64)
    assert not set(dst.tolist()) & set(src.tolist())
    assert engine.retrieve(tokens[:stored], dst) == stored
    assert rows_bytes(pool, dst) == expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [4, 16])
def test_retrieve_skips_device_prefix_and_minus_one_slots(engine_for: Any, page_size: int,
                                                          device: str) -> None:
    pool = make_pool("mha", page_size, torch.float16, device)
    alloc = make_allocator(pool, page_size)
    engine = engine_for(pool)
    tokens = torch.arange(3 * CHUNK)
    src = alloc.alloc(3 * CHUNK).to(torch.int64)
    fill(pool, src, seed=7)
    engine.store(tokens, src)

    dst = alloc.alloc(3 * CHUNK).to(torch.int64)
    fill(pool, dst, seed=8)
    untouched = rows_bytes(pool, dst[:CHUNK])
    mapping = dst.clone()
    mapping[:CHUNK] = -1
    assert engine.retrieve(tokens, mapping, skip=CHUNK) == 3 * CHUNK
    assert rows_bytes(pool, dst[:CHUNK]) == untouched
    assert rows_bytes(pool, dst[CHUNK:]) == rows_bytes(pool, src[CHUNK:])


@pytest.mark.parametrize("device", DEVICES)
def test_background_store_then_load_through_adapter(engine_for: Any, device: str) -> None:
    pool = make_pool("mla", 4, torch.bfloat16, device)
    alloc = make_allocator(pool, 4)
    kv = SGLangKVTier(engine_for(pool, 4), page_size=4)
    try:
        tokens = torch.arange(2 * CHUNK + 3).numpy()  # its last 3 tokens: less than a page
        src = alloc.alloc(2 * CHUNK + 4)[: len(tokens)].to(torch.int64)
        fill(pool, src, seed=3)
        assert kv.submit_store(tokens, src, handle="lock-1")
        done = kv.settle()  # handed back once the slots are read
        assert [job.handle for job in done] == ["lock-1"]
        assert kv.stores.drain(30)  # and stored everywhere
        assert done[0].stored == 2 * CHUNK and done[0].error is None
        assert kv.lookup(None, tokens) == 2 * CHUNK
        assert kv.loadable_end(len(tokens)) == 2 * CHUNK
        dst = alloc.alloc(2 * CHUNK).to(torch.int64)
        assert kv.retrieve(None, tokens[: 2 * CHUNK], dst, skip=0) == 2 * CHUNK
        assert rows_bytes(pool, dst) == rows_bytes(pool, src[: 2 * CHUNK])
        assert kv.stats()["sglang.tokens_loaded"] == 2 * CHUNK
    finally:
        kv.close()


def test_rank_that_does_not_store_hands_the_lock_back_at_once(engine_for: Any) -> None:
    pool = make_pool("mla", 1, torch.float32)
    kv = SGLangKVTier(engine_for(pool), page_size=1, stores=False)
    try:
        assert not kv.submit_store(torch.arange(CHUNK).numpy(),
                                   torch.arange(1, CHUNK + 1), handle="lock")
        assert kv.poll_done() == []
    finally:
        kv.close()


def test_chunk_size_must_be_a_multiple_of_the_page_size() -> None:
    check_page_size(Config(chunk_size=64), 16)
    with pytest.raises(ConfigError, match="chunk_size.*--page-size"):
        check_page_size(Config(chunk_size=48), 32)


def test_unsupported_pool_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="MHATokenToKVPool"):
        build_connector(object())


def test_model_names_become_one_key_component() -> None:
    assert model_key_name("meta-llama/Llama-3-8B", "ab12") == "meta-llama%2FLlama-3-8B@ab12"
    assert model_key_name("my model") == "my%20model"
    with pytest.raises(ConfigError):
        model_key_name("")


def test_the_model_fingerprint_follows_what_changes_the_kv(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from kvtier.integration.sglang.launch.identity import model_fingerprint

    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    args = SimpleNamespace(model_path=str(tmp_path), revision=None, quantization=None,
                           dtype="auto", json_model_override_args="{}", kv_cache_dtype="auto")
    base = model_fingerprint(args)
    assert model_fingerprint(args) == base  # deterministic
    for change in ({"revision": "v2"}, {"quantization": "fp8"},
                   {"json_model_override_args": '{"rope_scaling": 2}'}):
        assert model_fingerprint(SimpleNamespace(**{**vars(args), **change})) != base
    (tmp_path / "config.json").write_text('{"hidden_size": 128}')  # another fine-tune
    assert model_fingerprint(args) != base


class _QuickLoad(Prefetch):
    """A prefetch that ends during the first wait the adapter grants it (a fast miss)."""

    def __init__(self) -> None:
        super().__init__(make_keys(CHUNK))
        self.waits: list[float] = []

    def wait_ready(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.finish(0)
        return True


def test_a_new_requests_first_check_waits_briefly_for_its_prefetch(
        engine_for: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool("mla", 1, torch.float32)
    engine = engine_for(pool)
    quick, slow = _QuickLoad(), Prefetch(make_keys(CHUNK))
    # The engine hands out these two loads, so the adapter's own start_prefetch registers them.
    handed = iter([quick, slow])
    monkeypatch.setattr(engine, "start_prefetch", lambda *args, **kwargs: next(handed))
    kv = SGLangKVTier(engine, page_size=1)
    try:
        kv.start_prefetch("quick", np.arange(2 * CHUNK))  # nothing in the CPU tier: loads
        kv.start_prefetch("slow", np.arange(1000, 1000 + 2 * CHUNK))
        assert kv.pending_prefetches() == 2 and kv.stats()["sglang.prefetches"] == 2
        # Admitted at its first check, not a scheduler step later ...
        assert kv.prefetch_ready("quick") and quick.waits == [FIRST_CHECK_WAIT_S]
        # ... and a load that is still running is waited for only at the first check.
        assert not kv.prefetch_ready("slow") and not kv.prefetch_ready("slow")
        assert kv.stats()["sglang.prefetch_waits"] == 2
        slow.finish(0)
        assert kv.prefetch_ready("slow")
    finally:
        kv.close()


def _radix_cache(pool: Any, kv: SGLangKVTier) -> Any:
    """kvtier's radix cache over `pool`, as SGLang builds it (page size 1), with `kv` attached."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from kvtier.integration.sglang.rank.radix_cache import KVTierRadixCache

    cache = KVTierRadixCache(CacheInitParams(
        disable=False, page_size=1, token_to_kv_pool_allocator=make_allocator(pool, 1),
        tree_components=(ComponentType.FULL,),
        req_to_token_pool=ReqToTokenPool(8, POOL_TOKENS, "cpu", enable_memory_saver=False)))
    cache.attach_kvtier(kv)
    return cache


def _request(rid: str, ids: list[int], multimodal: bool) -> Any:
    from array import array

    from sglang.srt.managers.schedule_batch import MultimodalInputs, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=1))
    req.multimodal_inputs = MultimodalInputs(mm_items=[]) if multimodal else None
    req.refresh_fill_ids()  # what the scheduler does before matching
    return req


def test_multimodal_requests_bypass_kvtier(engine_for: Any) -> None:
    """SGLang writes a 30-bit hash of each image into the token ids: keyed fleet-wide, a
    collision would serve one image's KV for another. Such requests are neither looked up,
    prefetched nor stored; the same tokens as text are."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    pool = make_pool("mha", 1, torch.float32)
    engine = engine_for(pool)
    kv = SGLangKVTier(engine, page_size=1)
    try:
        cache = _radix_cache(pool, kv)
        ids = list(range(10, 10 + 3 * CHUNK + 1))
        slots = make_allocator(pool, 1).alloc(3 * CHUNK).to(torch.int64)
        fill(pool, slots, seed=5)
        assert engine.store(torch.tensor(ids[:3 * CHUNK]), slots) == 3 * CHUNK
        image, text = _request("image", ids, True), _request("text", ids, False)

        def match(req: Any) -> Any:
            key = RadixKey(token_ids=array("q", ids[:-1]), extra_key=None)
            return cache.match_prefix(MatchPrefixParams(key=key, req=req))

        # Looked up: the CPU tier holds the prefix, a host hit for the text request only.
        assert match(image).host_hit_length == 0
        assert match(text).host_hit_length == 3 * CHUNK

        # Prefetched: only the text request starts a load.
        cache.prefetch_from_storage(image, None, ids)
        assert kv.pending_prefetches() == 0
        cache.prefetch_from_storage(text, None, ids)
        assert kv.pending_prefetches() == 1 and kv.stats()["sglang.prefetches"] == 1

        # Stored: with the prefix in the device tree, only the text request's store is queued.
        cache.insert(InsertParams(key=RadixKey(token_ids=array("q", ids[:3 * CHUNK]),
                                               extra_key=None), value=slots))
        for req in (image, text):
            req.last_node = match(req).last_device_node
        cache._submit_store(image)  # what a finished request's checkpoint calls
        assert kv.pending_stores() == 0 and kv.settle() == []
        cache._submit_store(text)
        done = kv.settle()  # the store read its slots: the tree lock comes back
        assert len(done) == 1 and done[0].error is None
        cache.unlock(done[0].handle)
    finally:
        kv.close()


def test_a_flush_of_an_idle_tree_stalls_no_stream(engine_for: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's `/flush_cache` resets only an idle scheduler: however long kvtier's part takes,
    no stream waited, so it logs no warning; a reset while a request holds the tree would."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    pool = make_pool("mha", 1, torch.float32)
    kv = SGLangKVTier(engine_for(pool), page_size=1)
    try:
        cache = _radix_cache(pool, kv)
        kv.budget.warn_s = 0.0  # every reset is "slow"
        key = RadixKey(token_ids=array("q", range(10, 10 + CHUNK)), extra_key=None)

        def insert() -> None:
            slots = make_allocator(pool, 1).alloc(CHUNK).to(torch.int64)
            cache.insert(InsertParams(key=key, value=slots))

        insert()
        with caplog.at_level("DEBUG", logger="kvtier.integration.sglang.rank.budget"):
            cache.reset()
        assert "reset took" in caplog.text and "no request was in flight" in caplog.text
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        caplog.clear()
        insert()
        cache.inc_lock_ref(cache.match_prefix(MatchPrefixParams(key=key)).last_device_node)
        with caplog.at_level("DEBUG", logger="kvtier.integration.sglang.rank.budget"):
            cache.reset()  # as if a request were running on the tree
        assert [r for r in caplog.records if r.levelname == "WARNING"
                and "every running stream waited" in r.getMessage()]
    finally:
        kv.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda)])
def test_an_admitted_load_is_read_by_the_next_forward_with_the_overlap_streams(
        engine_for: Any, kind: str, device: str) -> None:
    # SGLang's overlap scheduler: the scheduler thread runs on a schedule stream (where
    # init_load_back enqueues the load), batches run on a forward stream that waits for the
    # schedule stream before each launch, and batch N may still run while N+1 is admitted.
    pool = make_pool(kind, 1, torch.bfloat16, device)
    alloc = make_allocator(pool, 1)
    engine = engine_for(pool)
    n = 3 * CHUNK
    tokens = torch.arange(n)
    src = alloc.alloc(n).to(torch.int64)
    fill(pool, src, seed=11)
    expected = rows_bytes(pool, src)
    assert engine.store(tokens, src) == n
    dst = alloc.alloc(n).to(torch.int64)
    schedule, forward = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(1_000_000_000)  # batch N, about half a second
    with torch.cuda.stream(schedule):
        assert engine.retrieve(tokens, dst) == n  # returns without waiting for the GPU
        forward.wait_stream(schedule)
    with torch.cuda.stream(forward):
        seen = [buf[dst].clone() for buf in buffers(pool)]  # batch N+1 reads the slots
    torch.cuda.synchronize()
    assert [t.view(torch.uint8).cpu().numpy().tobytes() for t in seen] == expected
