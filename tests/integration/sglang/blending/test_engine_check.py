"""`EngineSegmentCheck`: a verified request's first segment, read from the pool as SGLang computed
it, against every tier's records of that segment: a record that differs leaves its tier (counted
and logged), one that matches stays, and nothing is compared when no segment starts the prompt.
The pool here holds the segment's KV as the served model computes it (a real SGLang server:
tests/integration/sglang/test_sglang_segment_engine_check.py)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvtier.blend.forward import prefill
from kvtier.blend.segments import Segment
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.blending.engine_check import (
    ENGINE_CHECK_COUNTERS,
    EngineSegmentCheck,
)
from kvtier.memory import KVLayout
from kvtier.metrics import Counters
from tests.blend.conftest import tiny_llama

SEP = 100
DOC = np.arange(1, 25, dtype=np.int64)  # 24 tokens: a chunk of 16 and a tail of 8
PROMPT = np.concatenate([DOC, [SEP, 9, 8, 7, 6, 5]]).astype(np.int64)
SLOTS = torch.arange(40, 40 + len(PROMPT))  # where the request's KV stands in the pool


@pytest.fixture
def setup() -> Iterator[tuple[CacheEngine, EngineSegmentCheck, torch.Tensor]]:
    """An engine (CPU tier and disk), the check over a pool that holds the prompt's KV as the
    model computes it, and that KV of the document alone."""
    w = tiny_llama()
    layout = KVLayout.mha(num_layers=w.num_layers, num_kv_heads=w.num_kv_heads,
                          head_dim=w.head_dim, dtype=torch.float32)
    k = [torch.zeros(128, w.num_kv_heads, w.head_dim) for _ in range(w.num_layers)]
    v = [torch.zeros(128, w.num_kv_heads, w.head_dim) for _ in range(w.num_layers)]
    kv = prefill(w, torch.from_numpy(PROMPT), logits=False).kv  # [2, layers, tokens, width]
    for layer in range(w.num_layers):
        k[layer][SLOTS] = kv[0, layer].view(len(PROMPT), w.num_kv_heads, w.head_dim)
        v[layer][SLOTS] = kv[1, layer].view(len(PROMPT), w.num_kv_heads, w.head_dim)
    cfg = Config(chunk_size=16, max_local_cpu_size=0.05, save_tails=True,
                 enable_blending=True, blend_min_tokens=16)
    engine = CacheEngine(cfg, model_name="m", layout=layout,
                         connector=SGLangMHAConnector(k, v))
    counters = Counters(*(f"sglang.{name}" for name in ENGINE_CHECK_COUNTERS))
    check = EngineSegmentCheck(engine.segments(), (k, v), [SEP], 16, counters)
    yield engine, check, kv[:, :, :len(DOC)].clone()
    engine.close()


def _write(engine: CacheEngine, kv: torch.Tensor) -> None:
    store = engine.segments()
    assert store.save(store.chain(DOC, Segment(0, len(DOC))), kv) == len(DOC)


def test_a_record_that_the_pools_kv_refutes_leaves_the_tier(
        setup: tuple[CacheEngine, EngineSegmentCheck, torch.Tensor]) -> None:
    engine, check, honest = setup
    wrong = honest.clone()
    wrong[1, 2] *= 1.05  # one layer's values 5% off: what a faulty forward would store
    _write(engine, wrong)
    verdicts = check.check(PROMPT, SLOTS, "")
    assert verdicts is not None and [v.matched for v in verdicts] == [False, False]  # + tail
    assert verdicts[0].layer == 2
    assert check.counters.snapshot() == {"sglang.blend_segments_engine_checked": 1,
                                         "sglang.blend_segments_engine_mismatched": 1}
    assert engine.stats()["cpu.verify_mismatch"] == 2
    store = engine.segments()
    assert store.lookup(store.chain(DOC, Segment(0, len(DOC)))) == 0  # no blend reads it


def test_a_record_that_the_pools_kv_confirms_stays(
        setup: tuple[CacheEngine, EngineSegmentCheck, torch.Tensor]) -> None:
    engine, check, honest = setup
    _write(engine, honest)
    verdicts = check.check(PROMPT, SLOTS, "")
    assert verdicts is not None and len(verdicts) == 2 and all(v.matched for v in verdicts)
    assert "sglang.blend_segments_engine_mismatched" not in check.counters.snapshot()
    store = engine.segments()
    assert store.lookup(store.chain(DOC, Segment(0, len(DOC)))) == len(DOC)


def test_nothing_is_compared_unless_a_held_segment_starts_the_prompt(
        setup: tuple[CacheEngine, EngineSegmentCheck, torch.Tensor]) -> None:
    engine, check, honest = setup
    assert check.check(PROMPT, SLOTS, "") is None  # no tier holds the segment
    _write(engine, honest)
    assert check.check(PROMPT, SLOTS, "another salt") is None  # other keys
    later = np.concatenate([[SEP], PROMPT]).astype(np.int64)  # the segment at position 1
    assert check.check(later, torch.arange(39, 40 + len(PROMPT)), "") is None
    assert check.counters.snapshot() == {}
