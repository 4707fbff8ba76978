"""The default `adaptive` prefetch policy on a real server: a hit is loaded when the tier beats
recomputing it, and recomputed when it does not.

Server A stores long prompts in a real Redis. Two fresh servers then serve them with empty CPU
tiers: one reaching the Redis directly (a fast tier: the prompts load), one through a proxy
that delays every reply by far more than this tiny model needs to recompute a prompt (a slow
tier: the prompts are recomputed, with the same output).

Until a tier's round trip and read bandwidth are both measured, no request waits for it. This
model's records (64 KiB) are too small for the start-up probe to time a read, so the fast
server's primer request reads the tier first (in the background); the slow server's probe
times a round trip longer than any recompute here, which is enough to leave the tier out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.delay_proxy import DelayProxy
from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from tests.integration.sglang.conftest import cold, kvtier_metrics, prompt, write_config

pytestmark = pytest.mark.sglang

CHUNK = 64
LONG = 2200
SEEDS = (41, 42, 43)
PRIMER = 40  # stored too: the fast server's first hit, which measures the tier
# This model recomputes a LONG prompt in a fraction of that, even before its prefill speed is
# measured (the 2000 tokens/s prior: 1.1 s) and on a busy host.
SLOW_DELAY_S = 3.0
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
    # DEBUG: each plan (expected arrival, recompute saved) is in the log a failure shows.
    return write_config(tmp / "kvtier.yaml", chunk_size=CHUNK, max_local_cpu_size=0.2,
                        remote_url=url, remote_timeout_secs=10.0, prefetch_policy="adaptive",
                        log_level="DEBUG", **extra)


@pytest.fixture(scope="module")
def stored(start_server: Callable[..., SGLangServer], tiny_llama4: Path, redis: RedisProcess,
           tmp_path_factory: pytest.TempPathFactory) -> None:
    server = start_server(tiny_llama4, _config(tmp_path_factory.mktemp("a"), redis.url),
                          *LONG_CONTEXT, env=ENV)
    for seed in (PRIMER, *SEEDS):
        server.generate(prompt(seed, LONG))
    server.flush_cache()  # waits for the Redis writes
    server.stop()


def _adaptive(samples: dict[str, float]) -> dict[str, float]:
    """The estimates and the adaptive counters: why tokens were loaded or recomputed."""
    return {k: v for k, v in samples.items() if "_est_" in k or "_adaptive_" in k}


def _wait_until(server: SGLangServer, done: Callable[[dict[str, float]], bool],
                ) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:  # kvtier refreshes its series once a second
        samples = kvtier_metrics(server)
        if done(samples):
            return samples
        assert time.monotonic() < deadline, _adaptive(samples)
        time.sleep(0.5)


def _wait_for_metric(server: SGLangServer, name: str) -> dict[str, float]:
    return _wait_until(server, lambda samples: samples.get(name, 0) > 0)


def _settled_tokens(samples: dict[str, float]) -> float:
    """Prompt tokens the adaptive counters accounted for, loaded or recomputed."""
    return sum(v for k, v in samples.items() if k.startswith("kvtier_adaptive_tokens_"))


def test_a_fast_tier_is_loaded(start_server: Callable[..., SGLangServer], tiny_llama4: Path,
                               redis: RedisProcess, stored: None, tmp_path: Path) -> None:
    from kvtier.storage.prefetch.estimates import PRIOR_PREFILL_TOKENS_PER_S, PRIOR_READ_BYTES_PER_S

    server = start_server(tiny_llama4, _config(tmp_path, redis.url), *LONG_CONTEXT, env=ENV)
    recomputed = cold(server, prompt(SEEDS[0], LONG))  # also this server's prefill sample
    server.generate(prompt(PRIMER, LONG))  # loaded or not, its reads time the tier
    # A series is exported once a second: one not there yet is one not measured yet.
    primed = _wait_until(server, lambda samples: _settled_tokens(samples) >= 0.8 * LONG
                         and samples.get("kvtier_est_read_bytes_per_second",
                                         PRIOR_READ_BYTES_PER_S) != PRIOR_READ_BYTES_PER_S)

    got = server.generate(prompt(SEEDS[0], LONG))
    # The prefill speed is measured from the server's own batches (the cold one above), so it
    # has left the prior by now.
    samples = _wait_until(server, lambda samples: _settled_tokens(samples)
                          >= _settled_tokens(primed) + 0.8 * LONG
                          and samples.get("kvtier_est_prefill_tokens_per_second",
                                          PRIOR_PREFILL_TOKENS_PER_S)
                          != PRIOR_PREFILL_TOKENS_PER_S)
    assert got["meta_info"]["cached_tokens"] >= 0.8 * LONG, _adaptive(samples)
    assert got["output_ids"] == recomputed
    loaded = samples["kvtier_adaptive_tokens_loaded_total"] \
        - primed.get("kvtier_adaptive_tokens_loaded_total", 0)
    assert loaded >= 0.8 * LONG, _adaptive(samples)
    assert samples.get("kvtier_adaptive_tokens_recomputed_slower_than_recompute_total", 0) == 0
    assert samples["kvtier_est_read_bytes_per_second"] > 0
    assert samples["kvtier_est_prefill_tokens_per_second"] > 0


def test_a_tier_slower_than_recompute_is_recomputed(
        start_server: Callable[..., SGLangServer], tiny_llama4: Path, redis: RedisProcess,
        stored: None, tmp_path: Path) -> None:
    with DelayProxy(redis.port, SLOW_DELAY_S) as proxy:
        server = start_server(tiny_llama4, _config(tmp_path, proxy.url), *LONG_CONTEXT,
                              env=ENV)
        # The start-up probe times the round trip (its records are too small to time a read):
        # from then on, no request is held for this tier, and none asks it on admission.
        _wait_until(server, lambda samples: samples.get("kvtier_est_latency_seconds", 0)
                    >= SLOW_DELAY_S / 2)
        for seed in SEEDS[1:]:
            ids = prompt(seed, LONG)
            recomputed = cold(server, ids)  # also this server's prefill sample
            got = server.generate(ids)
            assert got["output_ids"] == recomputed
            assert got["meta_info"]["cached_tokens"] == 0
        chunks = LONG // CHUNK * CHUNK * len(SEEDS[1:])
        samples = _wait_until(server, lambda samples: samples.get(
            "kvtier_adaptive_tokens_recomputed_slower_than_recompute_total", 0) >= chunks)
        # A counter appears once counted: where every prefetch ended before its plan (a busy
        # host), nothing ever counted a load or a deadline, and absent means none.
        assert samples.get("kvtier_adaptive_tokens_loaded_total", 0) == 0, _adaptive(samples)
        assert samples.get("kvtier_adaptive_tokens_recomputed_deadline_total", 0) == 0
