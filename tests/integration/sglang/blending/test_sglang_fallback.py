"""A request that blending's planner computes instead of blending does no blend work (issue 75).

A real SGLang server (SmolLM2-135M-Instruct, float32) with `enable_blending`, its segments on
a disk tier and no CPU tier (`local_cpu: false`: a blend loads its segments first), and
`blend_max_prefill_ratio` so small that every measured blend loses. Two prompts store four
documents as segments; the first blend (two of them) runs unmeasured and loads its segments;
after it, a request whose other two segments the disk holds is computed, and starts no
segment load and no blend. Before, its prefetch loaded both segments (the test read 2 more
loads) and it waited in the queue for them before the planner chose to compute it. Asserted
through kvtier's counters and log lines, not timing.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.sglang_server import SGLangServer
from tests.integration.sglang.conftest import kvtier_metrics, write_config
from tests.integration.sglang.test_sglang_blending import _generate, _metric, _prompt

pytestmark = pytest.mark.sglang


def _segment_loads(server: SGLangServer) -> float:
    """Background loads started for segments so far: every load the tiers started, less those
    of requests' prefixes. Read once the exporter has synced at least once more (every
    second)."""
    time.sleep(2.5)
    got = kvtier_metrics(server)
    return got["kvtier_prefetches_total"] - got.get("kvtier_sglang_prefetches_total", 0.0)


@pytest.mark.timeout(900)  # a bound on a hang: kvtier's forward on a busy 2-core host
def test_a_request_the_planner_computes_reads_no_segment_and_starts_no_blend(
        real_model: Path, start_server: Callable[..., SGLangServer], tmp_path: Path) -> None:
    config = write_config(tmp_path / "blend.yaml", enable_blending=True, chunk_size=64,
                          blend_min_tokens=64, blend_recompute_ratios=[0.15],
                          local_cpu=False, local_disk=str(tmp_path / "disk"),
                          max_local_disk_size=1.0, blend_max_prefill_ratio=1e-9)
    server = start_server(real_model, config, "--max-total-tokens", "8192", "--enable-metrics")
    for docs in ([0, 1], [2, 3]):  # misses: their segments are computed alone, stored
        _generate(server, _prompt(docs))
    assert _metric(server, "blend_segments_stored", at_least=4) == 4

    server.flush_cache()
    _generate(server, _prompt([1, 0]))  # unmeasured: blends, its segments loaded first
    blends = re.findall(r"kvtier: blended \S+: (\d+) tokens from (\d+) segments", server.log())
    assert len(blends) == 1 and blends[0][1] == "2", server.log()[-3000:]
    before = _segment_loads(server)
    assert before >= 2  # the blend's: none of its segments was in the CPU tier

    server.flush_cache()
    _generate(server, _prompt([3, 2]))  # measured now: this blend would lose
    assert _metric(server, "blend_fallbacks_slower", at_least=1) == 1
    log = server.log()
    assert log.count("computed, not blended: a blend of") == 1, log[-3000:]
    # no segment of it was read ...
    assert _segment_loads(server) == before
    # ... and no blend was computed, off the scheduler thread or on it
    assert len(re.findall(r"kvtier: blended \S+: ", log)) == 1
    assert _metric(server, "blend_requests") == 1
    assert "Traceback" not in log
