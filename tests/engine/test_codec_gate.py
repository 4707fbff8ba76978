"""An engine refuses a `remote_serde` whose quality gate failed for its model (issue 72)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError

SMOLLM2 = "SmolLM2-135M-Instruct"  # fp8 failed its gate (docs/codecs.md)


def _engine(model: str, **cfg: object) -> CacheEngine:
    k = [torch.zeros(64, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.zeros(64, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    conn = SGLangMHAConnector(k, v)
    config = Config(chunk_size=16, max_local_cpu_size=0.01, **cfg)  # type: ignore[arg-type]
    return CacheEngine(config, model_name=model, layout=conn.layout, connector=conn)


def test_fp8_is_refused_for_a_model_that_failed_its_gate_unless_overridden(
        caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="remote_serde: fp8 failed its quality gate.*SmolLM2"):
        _engine(SMOLLM2, remote_serde="fp8")
    _engine(SMOLLM2).close()  # naive: no gate
    with caplog.at_level(logging.WARNING, logger="kvtier.engine"):
        _engine(SMOLLM2, remote_serde="fp8", remote_serde_override=True).close()
        _engine("other-model", remote_serde="fp8").close()
    said = [r.getMessage() for r in caplog.records if "remote_serde" in r.getMessage()]
    assert len(said) == 2 and "anyway" in said[0] and "never gated" in said[1]
