"""A real SGLang server with kvtier under a concurrent shared-prefix load (tiny Llama, CPU).

32 requests in 4 groups; the requests of a group share a 192-token prefix (12 chunks) and each
has its own 32-token suffix. Four client threads send them at once, groups interleaved, to a
server whose device KV pool (`--max-total-tokens 512`) holds about two requests: the working
set (4 prefixes + 32 suffixes, ~1.8K prompt tokens) does not fit, so SGLang's device prefix cache
evicts prefixes a later request of the same group needs, and kvtier (CPU + disk + Redis tiers,
`prefetch_policy: wait_complete`) loads them back.

Asserted: every request completes; each request's greedy output ids equal those of a server
without kvtier (same flags, the same prompt sent alone); kvtier loaded tokens into the pool
during the load (its "kvtier: loaded N tokens" log lines); and the disk and Redis tiers hold
records once `/flush_cache` has let the background writes land. No timing is asserted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from benchmarks.serving.timeline import forward_totals
from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from tests.integration.sglang.conftest import prompt, write_config

pytestmark = pytest.mark.sglang

GROUPS = 4
PER_GROUP = 8  # 32 requests
PREFIX = 192  # tokens shared by a group: 12 chunks of 16
SUFFIX = 32  # tokens of each request's own
NEW_TOKENS = 8
CONCURRENCY = 4
# A request is 224 prompt + 8 new tokens: two fit in the pool; the working set is ~3.5 pools.
POOL = ("--max-total-tokens", "512")
_LOADED = re.compile(r"kvtier: loaded (\d+) tokens")


def workload() -> list[list[int]]:
    """The prompts in sending order: request i belongs to group i % GROUPS."""
    prefixes = [prompt(100 + g, PREFIX) for g in range(GROUPS)]
    return [prefixes[i % GROUPS] + prompt(1000 + i, SUFFIX)
            for i in range(GROUPS * PER_GROUP)]


@pytest.fixture(scope="module")
def redis(redis_factory: Callable[..., RedisProcess]) -> RedisProcess:
    return redis_factory()


@pytest.fixture(scope="module")
def forward_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the baseline server's CPU plugin logs its model forwards (the benchmarks' log)."""
    return tmp_path_factory.mktemp("forwards") / "baseline.forward"


@pytest.fixture(scope="module")
def expected(start_server: Callable[..., SGLangServer], tiny_llama: Path,
             forward_log: Path) -> list[list[int]]:
    """Each prompt's greedy output ids from a server without kvtier, one request at a time."""
    baseline = start_server(tiny_llama, None, *POOL,
                            env={"KVTIER_BENCH_FORWARD_LOG": str(forward_log)})
    outputs = [list(baseline.generate(ids, NEW_TOKENS)["output_ids"]) for ids in workload()]
    baseline.stop()
    return outputs


def _send_all(server: SGLangServer, prompts: list[list[int]]
              ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """Every prompt through `CONCURRENCY` threads; (responses, errors) by request index. A
    failed request is reported, never retried."""
    def one(i: int) -> tuple[int, dict[str, Any] | None, str | None]:
        try:
            return i, server.generate(prompts[i], NEW_TOKENS), None
        except Exception as exc:  # reported by the test's assertion
            return i, None, repr(exc)

    responses: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        for i, response, error in pool.map(one, range(len(prompts))):
            if response is not None:
                responses[i] = response
            else:
                errors[i] = error or "no response"
    return responses, errors


def test_concurrent_shared_prefix_load_with_thrashing_device_cache(
        start_server: Callable[..., SGLangServer], tiny_llama: Path, redis: RedisProcess,
        expected: list[list[int]], tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    config = write_config(tmp_path / "kvtier.yaml", local_disk=str(disk),
                          max_local_disk_size=0.1, remote_url=redis.url,
                          remote_timeout_secs=5.0, prefetch_policy="wait_complete")
    server = start_server(tiny_llama, config, *POOL)
    prompts = workload()

    responses, errors = _send_all(server, prompts)

    assert errors == {}, f"{len(errors)} of {len(prompts)} requests failed: {errors}"
    assert len(responses) == len(prompts) == GROUPS * PER_GROUP
    mismatched = {i: (r["output_ids"], expected[i]) for i, r in responses.items()
                  if list(r["output_ids"]) != expected[i]}
    assert mismatched == {}, f"outputs differ from the server without kvtier: {mismatched}"
    for i, r in responses.items():
        assert r["meta_info"]["prompt_tokens"] == len(prompts[i])
        assert 0 <= r["meta_info"]["cached_tokens"] < len(prompts[i])

    loaded = [int(n) for n in _LOADED.findall(server.log())]
    assert loaded and sum(loaded) > 0, "kvtier never loaded a prefix the device cache evicted"

    server.flush_cache()  # waits for kvtier's stores and the disk and Redis writes
    assert redis.client().dbsize() > 0
    assert any(p.is_file() for p in disk.rglob("*"))


def test_the_cpu_plugin_logs_every_model_forward_when_asked(
        expected: list[list[int]], forward_log: Path) -> None:
    """`KVTIER_BENCH_FORWARD_LOG` (sglang_cpu/kvtier_sglang_cpu.py): the baseline server, sent
    each prompt alone, logged an extend per prompt and a decode per further output token."""
    prompts = workload()
    got = forward_totals(forward_log, 0.0, math.inf)
    assert got is not None
    assert got["extend_count"] >= len(prompts)
    assert 0 < got["extend_tokens"] <= sum(len(p) for p in prompts)
    assert got["decode_count"] == sum(len(out) - 1 for out in expected)
    assert got["decode_tokens"] == got["decode_count"]  # one request at a time: batches of one
    assert got["extend_cpu_s"] > 0 and got["extend_wall_s"] > 0
