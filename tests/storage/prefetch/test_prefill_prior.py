"""The prefill speed a fresh engine plans on: derived from the model's shape and the device's
measured matrix-product rate, capped on a CPU, replaced by the first measured prefill."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.storage.prefetch.estimates import PRIOR_PREFILL_TOKENS_PER_S, PrefillSpeed
from kvtier.storage.prefetch.prefill_prior import (
    EFFICIENCY,
    ModelShape,
    matmul_flops,
    prefill_prior,
)

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3}
LLAMA3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_a_tokens_flops_are_its_projections_and_mlp() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    assert shape == ModelShape(30, 576, 1536, 9, 3, 64)
    per_layer = 576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536  # q, o, k, v; gate, up, down
    assert shape.flops_per_token == 2 * 30 * per_layer
    big = ModelShape.from_config(LLAMA3_8B)
    assert big is not None and 13e9 < big.flops_per_token < 15e9  # ~2 x 7B matmul weights


@pytest.mark.parametrize("bad", [{}, {**TINY, "hidden_size": None},
                                 {**TINY, "num_hidden_layers": 0},
                                 {**TINY, "intermediate_size": "big"},
                                 {**TINY, "hidden_size": True}])
def test_a_config_it_cannot_read_gives_no_shape(bad: dict[str, object]) -> None:
    assert ModelShape.from_config(bad) is None


def test_a_large_model_on_a_cpu_is_costed_by_its_flops(caplog: pytest.LogCaptureFixture) -> None:
    shape = ModelShape.from_config(LLAMA3_8B)
    assert shape is not None
    caplog.set_level(logging.INFO, logger="kvtier")
    prior = prefill_prior(shape, torch.device("cpu"), torch.float32)
    # Far below the constant: 14 GFLOP a token is seconds a prompt on any CPU.
    assert 0 < prior < PRIOR_PREFILL_TOKENS_PER_S
    # The rate behind it is a real product's: positive and finite (how fast is the host's).
    rate = matmul_flops(shape.hidden, shape.intermediate, torch.device("cpu"), torch.float32)
    assert 0 < rate < float("inf") and rate * EFFICIENCY / shape.flops_per_token > 0
    assert "prefill speed before the first measured prefill" in caplog.text


def test_a_small_model_on_a_cpu_keeps_the_measured_small_model_speed() -> None:
    shape = ModelShape.from_config(TINY)
    assert shape is not None  # 147 KFLOP a token: its prefill is fixed cost, not FLOPs
    assert prefill_prior(shape, torch.device("cpu"), torch.float32) == PRIOR_PREFILL_TOKENS_PER_S


def test_the_first_measured_prefill_replaces_the_prior() -> None:
    speed = PrefillSpeed()
    speed.set_prior(123.0)
    assert speed.tokens_per_s(4096) == 123.0
    speed.observe(4096, 4096 / 800.0, 4096)
    assert speed.tokens_per_s(4096) == pytest.approx(800.0)
    with pytest.raises(ValueError, match="prior_tokens_per_s"):
        speed.set_prior(0.0)


def test_an_engine_plans_on_its_models_prior() -> None:
    k = [torch.zeros(64, 2, 8) for _ in range(2)]
    conn = SGLangMHAConnector(k, [t.clone() for t in k])
    cfg = Config(chunk_size=16, max_local_cpu_size=0.01)
    with CacheEngine(cfg, model_name="m", layout=conn.layout, connector=conn) as engine:
        prefill = engine._storage.prefill
        engine.prefill.plan_from({"architectures": ["LlamaForCausalLM"]})  # unreadable: as is
        assert prefill.prior == PRIOR_PREFILL_TOKENS_PER_S
        engine.prefill.plan_from(LLAMA3_8B)
        assert prefill.prior < PRIOR_PREFILL_TOKENS_PER_S


def test_a_product_that_cannot_run_keeps_the_constant(caplog: pytest.LogCaptureFixture) -> None:
    # A config whose width no host can allocate: the timed product fails for real.
    shape = ModelShape.from_config({**TINY, "hidden_size": 10**12, "num_attention_heads": 1})
    assert shape is not None
    caplog.set_level(logging.INFO, logger="kvtier")
    threads = torch.get_num_threads()
    assert prefill_prior(shape, torch.device("cpu"), torch.float32) is None
    assert "could not time a cpu float32 linear layer" in caplog.text
    assert torch.get_num_threads() == threads  # timed on one thread, then restored
