"""The default `adaptive` prefetch policy on a real server: a hit is loaded when the tier beats
recomputing it, and recomputed when it does not.

Server A stores long prompts in a real Redis. Two fresh servers then serve them with empty CPU
tiers: one reaching the Redis directly (a fast tier: the prompts load), one through a proxy
that delays every reply by far more than this tiny model needs to recompute a prompt (a slow
tier: the prompts are recomputed, with the same output).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RedisProcess
from tests.delay_proxy import DelayProxy
from tests.integration.conftest import cold, kvtier_metrics, prompt, write_config
from tests.sglang_support.server import SGLangServer

pytestmark = pytest.mark.sglang

CHUNK = 64
LONG = 2200
SEEDS = (41, 42, 43)
SLOW_DELAY_S = 1.0  # this model recomputes a LONG prompt in a fraction of that
LONG_CONTEXT = ("--context-length", "4096", "--max-total-tokens", "12288", "--enable-metrics")
ENV = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}


@pytest.fixture(scope="module")
def redis(redis_factory: Callable[..., RedisProcess]) -> RedisProcess:
    return redis_factory()


@pytest.fixture(scope="module")
def tiny_llama4(models_dir: Path) -> Path:
    from kvtier.demo.models import make_llama

    return make_llama(models_dir / "tiny-llama-4l", layers=4)


def _config(tmp: Path, url: str, **extra: Any) -> Path:
    return write_config(tmp / "kvtier.yaml", chunk_size=CHUNK, max_local_cpu_size=0.2,
                        remote_url=url, remote_timeout_secs=10.0, prefetch_policy="adaptive",
                        **extra)


@pytest.fixture(scope="module")
def stored(start_server: Callable[..., SGLangServer], tiny_llama4: Path, redis: RedisProcess,
           tmp_path_factory: pytest.TempPathFactory) -> None:
    server = start_server(tiny_llama4, _config(tmp_path_factory.mktemp("a"), redis.url),
                          *LONG_CONTEXT, env=ENV)
    for seed in SEEDS:
        server.generate(prompt(seed, LONG))
    server.flush_cache()  # waits for the Redis writes
    server.stop()


def _wait_for_metric(server: SGLangServer, name: str) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:  # kvtier refreshes its series once a second
        samples = kvtier_metrics(server)
        if samples.get(name, 0) > 0:
            return samples
        assert time.monotonic() < deadline, sorted(samples)
        time.sleep(0.5)


def test_a_fast_tier_is_loaded(start_server: Callable[..., SGLangServer], tiny_llama4: Path,
                               redis: RedisProcess, stored: None, tmp_path: Path) -> None:
    server = start_server(tiny_llama4, _config(tmp_path, redis.url), *LONG_CONTEXT, env=ENV)
    recomputed = cold(server, prompt(SEEDS[0], LONG))  # also this server's prefill sample
    got = server.generate(prompt(SEEDS[0], LONG))
    assert got["meta_info"]["cached_tokens"] >= 0.8 * LONG
    assert got["output_ids"] == recomputed
    samples = _wait_for_metric(server, "kvtier_adaptive_tokens_loaded_total")
    assert samples["kvtier_adaptive_tokens_loaded_total"] >= 0.8 * LONG
    assert samples["kvtier_est_read_bytes_per_second"] > 0
    assert samples["kvtier_est_prefill_tokens_per_second"] > 0


def test_a_tier_slower_than_recompute_is_recomputed(
        start_server: Callable[..., SGLangServer], tiny_llama4: Path, redis: RedisProcess,
        stored: None, tmp_path: Path) -> None:
    with DelayProxy(redis.port, SLOW_DELAY_S) as proxy:
        server = start_server(tiny_llama4, _config(tmp_path, proxy.url), *LONG_CONTEXT,
                              env=ENV)
        for seed in SEEDS[1:]:
            ids = prompt(seed, LONG)
            recomputed = cold(server, ids)
            got = server.generate(ids)
            assert got["output_ids"] == recomputed
            assert got["meta_info"]["cached_tokens"] == 0
        # The first request measured the round trip; the second did not even ask.
        samples = _wait_for_metric(
            server, "kvtier_adaptive_tokens_recomputed_slower_than_recompute_total")
        assert samples["kvtier_est_latency_seconds"] >= SLOW_DELAY_S / 2


def test_the_prefill_speed_is_measured_from_the_servers_own_batches(
        start_server: Callable[..., SGLangServer], tiny_llama4: Path, redis: RedisProcess,
        tmp_path: Path) -> None:
    from kvtier.storage.estimates import PRIOR_PREFILL_TOKENS_PER_S

    server = start_server(tiny_llama4, _config(tmp_path, redis.url), *LONG_CONTEXT, env=ENV)
    cold(server, prompt(44, LONG))  # one extend batch of LONG tokens
    deadline = time.monotonic() + 30  # kvtier refreshes its series once a second
    while True:
        speed = kvtier_metrics(server).get("kvtier_est_prefill_tokens_per_second")
        if speed is not None and speed != PRIOR_PREFILL_TOKENS_PER_S:
            break
        assert time.monotonic() < deadline, f"the prefill speed stayed the prior ({speed})"
        time.sleep(0.5)
    assert speed > 0
