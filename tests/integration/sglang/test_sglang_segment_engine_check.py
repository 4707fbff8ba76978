"""Segment records checked against SGLang's own KV (issue 75 item 4), on a real SGLang server
(SmolLM2-135M-Instruct, float32, tensor parallel 1).

The test plugin puts a fault that computes the same wrong KV every time where a file says
(`KVTIER_TEST_SKEW_SEGMENTS`):
- in kvtier's own forward (`kvtier`): at TP 1 SGLang's model computes the segments alone, so
  the records stored under that fault are SGLang's and pass every check, and a record it did
  not compute (a non-leading segment's) is refuted by the background check;
- in whatever computes the segments (`records`): the records are wrong, and the background
  check, computed the same way, agrees with them. A verified request whose prompt starts with
  such a segment computes it with SGLang's extend, at position 0, and that KV accuses the
  records: they leave the tier, counted and logged, so the next prompt holding that segment
  finds no record of it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.sglang_server import SGLangServer
from kvtier.cli import tiers as cli_tiers
from kvtier.demo import texts
from tests.integration.sglang.conftest import kvtier_metrics, write_config

pytestmark = pytest.mark.sglang

ADMIN = "kvtier-segment-admin"
SEPARATOR = " # # "
ASK = "Question: Which depot is listed first?"
_rng = random.Random(11)
DOCS = [" ".join(texts.record(i, f) for i, f in enumerate(texts.facts(_rng, 12)))
        for _ in range(4)]  # about 230 tokens each


def _prompt(order: list[int]) -> str:
    """The documents in `order`, the first at position 0: it starts the prompt."""
    return "".join(DOCS[i] + SEPARATOR for i in order) + ASK


def _generate(server: SGLangServer, text: str) -> None:
    server.post("/generate", {"text": text, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}})


def _metric(server: SGLangServer, name: str, at_least: float = 0.0) -> float:
    """kvtier's counter `name` once it reaches `at_least` (the exporter syncs every second)."""
    deadline = time.monotonic() + 180  # a bound on a hang, not a timing assertion
    while (value := kvtier_metrics(server).get(f"kvtier_{name}_total", 0.0)) < at_least:
        assert time.monotonic() < deadline, f"{name} = {value} < {at_least}"
        time.sleep(0.5)
    return value


def _verify(server: SGLangServer, fraction: float) -> None:
    status, body = cli_tiers.request(server.url, {"op": "verify", "fraction": fraction}, ADMIN)
    assert status == 200, body


@pytest.mark.timeout(900)
def test_a_segment_record_that_sglangs_own_kv_refutes_is_removed_and_a_true_one_kept(
        real_model: Path, start_server: Callable[..., SGLangServer], tmp_path: Path) -> None:
    skew = tmp_path / "skew"
    config = write_config(tmp_path / "blend.yaml", enable_blending=True, chunk_size=64,
                          blend_min_tokens=64, max_local_cpu_size=0.2)
    server = start_server(real_model, config, "--max-total-tokens", "8192", "--enable-metrics",
                          "--admin-api-key", ADMIN,
                          env={"KVTIER_TEST_SKEW_SEGMENTS": str(skew)})
    assert "segments alone are computed by SGLang's model" in server.log()
    stored, verified = "sglang_blend_segments_stored", "sglang_blend_segments_verified"
    skew.write_text("records")  # documents 0 and 1 stored wrong
    _generate(server, _prompt([0, 1]))
    assert _metric(server, stored, at_least=2) == 2
    skew.write_text("kvtier")  # documents 2 and 3 stored while kvtier's own forward is wrong
    _generate(server, _prompt([2, 3]))
    assert _metric(server, stored, at_least=4) == 4

    # A verified request that starts with document 2: SGLang's KV of it confirms its records,
    # so they are not kvtier's forward's; the background check (SGLang's model) confirms them.
    server.flush_cache()  # nothing in the device tree: the prompt is computed from token 0
    _verify(server, 1)
    _generate(server, _prompt([2]))
    checked = "sglang_blend_segments_engine_checked"
    assert _metric(server, checked, at_least=1) == 1
    assert _metric(server, "sglang_blend_segments_engine_mismatched") == 0
    assert _metric(server, verified, at_least=1) == 1
    assert _metric(server, "sglang_blend_segments_mismatched") == 0

    # Document 1 after document 2: no extend computes it alone, but the background check does,
    # in SGLang's model, and refutes its wrong records (the fresh KV takes their place).
    server.flush_cache()
    _generate(server, _prompt([2, 1]))
    assert _metric(server, verified, at_least=3) == 3  # waited for: the fault changes next
    assert _metric(server, "sglang_blend_segments_mismatched", at_least=1) == 1
    assert _metric(server, "sglang_blend_segments_engine_mismatched") == 0

    # One that starts with document 0, while the records' fault persists (so the background
    # check agrees with the wrong records): SGLang's KV of the prompt refutes them.
    skew.write_text("records")
    server.flush_cache()
    _generate(server, _prompt([0]))
    assert _metric(server, checked, at_least=3) == 3
    assert _metric(server, "sglang_blend_segments_engine_mismatched", at_least=1) == 1
    assert _metric(server, "verify_mismatch", at_least=1) >= 1  # counted in the CPU tier's
    assert "differs from SGLang's own KV of it" in server.log()
    assert _metric(server, verified, at_least=4) == 4
    assert _metric(server, "sglang_blend_segments_mismatched") == 1
    skew.unlink()

    # The next prompt that starts with document 0 finds no record of it (a blend would find
    # none either): it is computed, and the segment is stored again, by SGLang's model.
    _verify(server, 0)
    server.flush_cache()
    _generate(server, _prompt([0]))
    assert _metric(server, stored, at_least=5) == 5
    assert "Traceback" not in server.log()
