"""kvtier's metrics on SGLang's own `/metrics` (`--enable-metrics`, multiprocess mode)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.sglang_server import SGLangServer
from tests.integration.sglang.conftest import (
    PROMPT_LEN,
    full_hit,
    kvtier_metrics,
    prompt,
    write_config,
)
from tests.support.metric_docs import undocumented

pytestmark = pytest.mark.sglang


def test_kvtier_series_on_sglangs_metrics_endpoint(
        start_server: Callable[..., SGLangServer], tiny_llama: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "kvtier.yaml", local_disk=str(tmp_path / "disk"),
                          max_local_disk_size=0.1)
    server = start_server(tiny_llama, config, "--enable-metrics")
    ids = prompt(40, PROMPT_LEN)
    server.generate(ids)
    server.flush_cache()
    assert server.generate(ids)["meta_info"]["cached_tokens"] == full_hit(server)
    deadline = time.monotonic() + 30
    while True:  # kvtier refreshes its series once a second
        samples = kvtier_metrics(server)
        if samples.get("kvtier_tokens_loaded_total", 0) >= full_hit(server):
            break
        assert time.monotonic() < deadline, sorted(samples)
        time.sleep(0.5)
    assert samples["kvtier_tokens_stored_total"] >= full_hit(server)
    assert samples["kvtier_sglang_loads_total"] >= 1
    assert samples["kvtier_arena_bytes"] > 0
    assert samples["kvtier_tier_op_seconds_count"] > 0
    # The reload's hit was all in the CPU tier: admitted with no prefetch round, and timed.
    assert samples["kvtier_sglang_prefetches_skipped_hot_total"] >= 1
    assert samples["kvtier_hit_seconds_count"] >= 3  # its lookup, copy and insert
    # every family a server exports is documented, under its full name
    missing = undocumented(samples)
    assert not missing, f"add these to docs/metrics.md: {missing}"
