"""One object per request per rank (issue 73, item 1): `RankRequests` keeps each request's
state from its first call to the one place it is forgotten, within a bound that never drops a
running prefetch."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from kvtier.integration.sglang.rank.request_state import Loaded, RankRequests, VerifyCut
from kvtier.storage.prefetch.handle import Prefetch
from tests.helpers import SMALL_MHA


def test_a_state_is_made_once_and_forgotten_whole() -> None:
    table = RankRequests()
    state = table.open("a")
    state.found, state.verify = 64, VerifyCut(16, True)
    assert table.open("a") is state and "a" in table
    assert table.forget("a") is state
    assert table.get("a") is None and table.forget("a") is None and len(table) == 0


def test_past_its_bound_the_table_sheds_idle_requests_never_a_running_prefetch() -> None:
    table = RankRequests(limit=8)
    for i in range(4):
        table.add_prefetch(f"p{i}", Prefetch([]))
    for i in range(100):
        table.open(f"idle{i}")
        assert len(table) <= 8
    assert all(f"p{i}" in table for i in range(4))
    assert table.prefetching() == 4
    assert "idle99" in table  # the newest is kept
    assert sum(f"idle{i}" in table for i in range(100)) <= 4


def test_a_flush_drops_promises_and_loads_not_prefetches() -> None:
    table = RankRequests()
    state = table.open("a")
    state.loaded = Loaded(32, 0)
    table.add_prefetch("a", Prefetch([]))
    table.drop_loads()
    assert state.loaded is None and state.promise is None and state.prefetch is not None
    taken = table.take_prefetches()
    assert len(taken) == 1 and state.prefetch is None and table.prefetching() == 0


def test_a_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="limit"):
        RankRequests(limit=0)


def test_the_adapter_hashes_a_request_once_and_forgets_it_at_its_store_or_abort() -> None:
    chunk, tokens = 16, 64
    shape = (tokens + 1, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim)
    pool = [torch.randn(shape).to(SMALL_MHA.dtype) for _ in range(2 * SMALL_MHA.num_layers)]
    engine = CacheEngine(Config(chunk_size=chunk, max_local_cpu_size=0.01), model_name="m",
                         layout=SMALL_MHA, connector=SGLangMHAConnector(pool[::2], pool[1::2]))
    kv = SGLangKVTier(engine, page_size=1)
    try:
        ids, slots = torch.arange(100, 100 + tokens), torch.arange(1, tokens + 1)
        assert engine.store(ids, slots) == tokens
        for rid in ("done", "gone"):
            assert kv.lookup(rid, ids.numpy(), limit=tokens) == tokens
            prefix = kv.requests.get(rid).prefix
            kv.start_prefetch(rid, ids.numpy())
            assert kv.prefix(rid, ids.numpy()).chain is prefix.chain  # hashed once
        assert kv.submit_store(ids.numpy(), slots.clone(), "handle", rid="done")
        kv.cancel_prefetch("gone")
        assert "done" not in kv.requests and "gone" not in kv.requests
        assert kv.settle()
    finally:
        kv.close()
        engine.close()
