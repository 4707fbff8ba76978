"""The SGLang adapter's verified requests, as SGLang's scheduler drives it: what they cost is
counted (`kvtier_sglang_verified_tokens_total`: the tokens a tier held, which a hit would have
loaded), and with `verify_scope: tail` a request loads all but its hit's last full chunk.
Real SGLang servers verify in test_sglang_verify.py and the quality gate."""

from __future__ import annotations

import functools
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.redis import RedisProcess
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.admin.ops import apply
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from tests.helpers import SMALL_MHA

CHUNK, TOKENS, HELD = 16, 64, 48  # the tiers hold the first 3 of the prompt's 4 chunks


def _engine(fraction: float = 1.0) -> CacheEngine:
    shape = (TOKENS + 1, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim)
    pool = [torch.randn(shape).to(SMALL_MHA.dtype) for _ in range(2 * SMALL_MHA.num_layers)]
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.01, verify_fraction=fraction)
    return CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                       connector=SGLangMHAConnector(pool[::2], pool[1::2]))


@pytest.fixture
def kv() -> Iterator[SGLangKVTier]:
    engine = _engine()
    adapter = SGLangKVTier(engine, page_size=1)
    yield adapter
    adapter.close()
    engine.close()


def _verify_stored(kv: SGLangKVTier, tokens: torch.Tensor, slots: torch.Tensor,
                   rid: str) -> dict[str, float]:
    """Submit request `rid`'s store, wait for it and return the adapter's counters."""
    assert kv.submit_store(tokens.numpy(), slots.clone(), "handle", rid=rid)
    assert kv.settle()
    return dict(kv.counters.snapshot(declared=True))


def test_a_verified_request_counts_the_tokens_a_hit_would_have_loaded(
        kv: SGLangKVTier) -> None:
    engine = kv.engine
    tokens, slots = torch.arange(100, 100 + TOKENS), torch.arange(1, TOKENS + 1)
    assert engine.store(tokens[:HELD], slots[:HELD]) == HELD
    assert kv.shadowed("req", device_len=0)  # a share of 1: computed, not loaded
    counts = _verify_stored(kv, tokens, slots, "req")
    assert counts["sglang.verified_requests"] == 1
    assert counts["sglang.verified_tokens"] == HELD  # the 4th chunk was held by no tier
    assert counts["sglang.tokens_stored"] == TOKENS - HELD
    checked = engine._storage.counters.snapshot(declared=True)
    assert checked.get("cpu.verify_checked", 0) == HELD // CHUNK, checked


def test_scope_tail_loads_all_but_the_hit_s_last_full_chunk(kv: SGLangKVTier) -> None:
    answer = apply(kv, {"op": "verify", "scope": "tail"})
    assert answer["verify_scope"] == "tail" and answer["verify_fraction"] == 1.0
    assert not kv.shadowed("full", device_len=0)  # scope tail: nothing is verified in full
    assert kv.shadow_tail("a", device_len=0, hit=HELD) == HELD - CHUNK
    assert kv.shadow_tail("b", device_len=0, hit=HELD + 5) == HELD - CHUNK  # a tail loads too
    assert kv.shadow_tail("c", device_len=40, hit=HELD) == 40  # no chunk to spare: computed
    tokens, slots = torch.arange(100, 100 + TOKENS), torch.arange(1, TOKENS + 1)
    assert kv.engine.store(tokens[:HELD], slots[:HELD]) == HELD
    counts = _verify_stored(kv, tokens, slots, "a")  # loaded up to 32, computed from there
    assert counts["sglang.verified_tokens"] == CHUNK  # the held chunk it computed: one
    assert counts["sglang.tokens_stored"] == TOKENS - HELD
    apply(kv, {"op": "verify", "fraction": 0.0})
    assert kv.shadow_tail("d", device_len=0, hit=HELD) == HELD  # off: the whole hit loads


@pytest.mark.parametrize("request_, named", [
    ({"op": "verify", "scope": "head"}, "scope: must be one of full, tail, got 'head'"),
    ({"op": "verify", "fraction": 2, "scope": "tail"}, "fraction: must be a number in [0, 1]"),
    ({"op": "verify"}, "fraction: a verify op needs a fraction, a scope or both"),
])
def test_the_verify_op_refuses_a_bad_value_before_changing_either(
        kv: SGLangKVTier, request_: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError) as refused:
        apply(kv, request_)
    assert named in str(refused.value)
    assert (kv.engine.verify_fraction, kv.engine.verify_scope) == (1.0, "full")


class _Group:
    """A MIN all-reduce over ranks that are threads: each rank's n-th call meets the others'."""

    def __init__(self, ranks: int):
        self._barrier = threading.Barrier(ranks, timeout=30)
        self._lock = threading.Lock()
        self._calls: dict[int, list[int]] = {}
        self._done = threading.local()

    def reduce_min(self, t: torch.Tensor) -> None:
        n = getattr(self._done, "calls", 0)
        self._done.calls = n + 1
        with self._lock:
            self._calls.setdefault(n, []).append(int(t.item()))
        self._barrier.wait()
        t.fill_(min(self._calls[n]))


def test_tp_ranks_verify_the_same_requests_and_other_servers_other_ones() -> None:
    """Issue 67: the sampled requests are chosen by a secret, not by the client's request id;
    the ranks of one server agree on the secret when their adapters are built (in step), so
    every rank verifies the same requests, while two servers verify different ones."""
    ids = [f"req-{i}" for i in range(2000)]
    group = _Group(2)
    engines = [_engine(0.5) for _ in range(3)]
    built: list[SGLangKVTier] = []
    ranks = [threading.Thread(target=lambda e=e: built.append(
        SGLangKVTier(e, page_size=1, reduce_min=group.reduce_min))) for e in engines[:2]]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(60)
    built.append(SGLangKVTier(engines[2], page_size=1))  # another server: its own secret
    try:
        assert len(built) == 3
        chosen = [{r for r in ids if e.verifies(r)} for e in engines]
        assert chosen[0] == chosen[1]  # the TP ranks of one server
        assert chosen[0] != chosen[2]
        assert all(0.45 < len(c) / len(ids) < 0.55 for c in chosen)
    finally:
        for adapter in built:
            adapter.close()
        for engine in engines:
            engine.close()


def test_a_forged_redis_tail_loses_only_its_records_through_the_scheduler_s_calls(
        tmp_path: Path, redis_server: RedisProcess) -> None:
    """Issue 67: the reported case as the scheduler drives it. This server computed chunks 0-2
    (CPU tier, disk, Redis); a forged plain record of chunk 3 sits in Redis alone. A request
    verified by its tail prefetches chunk 3 from Redis, loads chunks 0-2 from the CPU tier and
    computes chunk 3, which matches no record. Before, that purged all 9 honest records; the
    prefix's supplier holds no record of chunk 3, so only Redis's record and the CPU tier's
    copy of it go, and the store writes the fresh chunk in their place."""
    tokens, slots = torch.arange(100, 169), torch.arange(1, 70)  # 4 full chunks and 5 tokens
    shape = (70, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim)
    pool = [torch.randn(shape).to(SMALL_MHA.dtype) for _ in range(2 * SMALL_MHA.num_layers)]
    forged = [buf.clone() for buf in pool]
    for buf in forged:
        buf[slots[HELD:TOKENS]] = torch.randn(CHUNK, *shape[1:]).to(buf.dtype)
    config = functools.partial(Config, chunk_size=CHUNK, max_local_cpu_size=0.01,
                               save_tails=False, remote_url=redis_server.url,
                               key_namespace=f"t{uuid.uuid4().hex[:8]}")
    forger = CacheEngine(config(), model_name="m", layout=SMALL_MHA,
                         connector=SGLangMHAConnector(forged[::2], forged[1::2]))
    engine = CacheEngine(config(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05,
                                verify_fraction=1.0, verify_scope="tail",
                                prefetch_policy="wait_complete"),
                         model_name="m", layout=SMALL_MHA,
                         connector=SGLangMHAConnector(pool[::2], pool[1::2]))
    kv = SGLangKVTier(engine, page_size=1)
    try:
        assert engine.store(tokens[:HELD], slots[:HELD]) == HELD and engine.flush(30)
        assert forger.store(tokens, slots) == TOKENS and forger.flush(30)
        ids = tokens.numpy()
        kv.start_prefetch("r", ids)
        # wait for the load itself (a busy host may take longer than any number of polls)
        assert kv.requests.get("r").prefetch.wait_done(30) and kv.prefetch_ready("r")
        hit = kv.lookup("r", ids, limit=kv.loadable_end(len(ids)))
        assert hit == TOKENS  # chunk 3 came from Redis
        cut = kv.shadow_tail("r", device_len=0, hit=hit)
        assert cut == HELD and kv.retrieve("r", ids, slots, skip=0, limit=cut) == HELD
        counts = _verify_stored(kv, tokens, slots, "r")
        assert counts["sglang.tokens_stored"] == CHUNK  # not a purge: the fresh chunk 3
        assert engine.flush(30)
        keys = engine.key_chain(tokens)
        assert [t.batch_contains(keys) for t in engine._storage.tiers] == [4, 4, 4]
        assert not engine.verify(tokens, slots).mismatches  # every record honest now
    finally:
        kv.close()
        engine.close()
        forger.close()
