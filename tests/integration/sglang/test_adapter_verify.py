"""The SGLang adapter's verified requests, as SGLang's scheduler drives it: what they cost is
counted (`kvtier_sglang_verified_tokens_total`: the tokens a tier held, which a hit would have
loaded). Real SGLang servers verify in test_sglang_verify.py and the quality gate."""

from __future__ import annotations

import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.adapter import SGLangKVTier
from tests.helpers import SMALL_MHA

CHUNK, TOKENS, HELD = 16, 64, 48  # the tiers hold the first 3 of the prompt's 4 chunks


def test_a_verified_request_counts_the_tokens_a_hit_would_have_loaded() -> None:
    shape = (TOKENS + 1, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim)
    pool = [torch.randn(shape).to(SMALL_MHA.dtype) for _ in range(2 * SMALL_MHA.num_layers)]
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.01, verify_fraction=1.0)
    engine = CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                         connector=SGLangMHAConnector(pool[::2], pool[1::2]))
    kv = SGLangKVTier(engine, page_size=1)
    tokens, slots = torch.arange(100, 100 + TOKENS), torch.arange(1, TOKENS + 1)
    try:
        assert engine.store(tokens[:HELD], slots[:HELD]) == HELD
        assert kv.shadowed("req", device_len=0)  # a share of 1: computed, not loaded
        assert kv.submit_store(tokens.numpy(), slots.clone(), "handle", rid="req")
        assert kv.settle()
        counts = kv.counters.snapshot(declared=True)
        assert counts["sglang.verified_requests"] == 1
        assert counts["sglang.verified_tokens"] == HELD  # the 4th chunk was held by no tier
        assert counts["sglang.tokens_stored"] == TOKENS - HELD
        checked = engine.storage.counters.snapshot(declared=True)
        assert checked.get("cpu.verify_checked", 0) == HELD // CHUNK, checked
    finally:
        kv.close()
        engine.close()
