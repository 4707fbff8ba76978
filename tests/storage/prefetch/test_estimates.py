"""Online speed estimates: robust to outliers, following change, converging on a real tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from harness.delay_proxy import DelayProxy
from harness.redis import RedisProcess
from kvtier.config import Config
from kvtier.memory import KVLayout, lease
from kvtier.storage import StorageManager
from kvtier.storage.prefetch.estimates import (
    PRIOR_PREFILL_TOKENS_PER_S,
    PRIOR_READ_BYTES_PER_S,
    WINDOW,
    PrefillSpeed,
    TierSpeed,
)
from tests.helpers import make_keys, make_obj


def test_one_outlier_moves_an_estimate_not_at_all() -> None:
    tier = TierSpeed("t")
    for _ in range(5):
        tier.observe_latency(0.010)
    tier.observe_latency(5.0)  # a GC pause, a reconnect
    assert tier.latency_s == pytest.approx(0.010)


def test_a_tier_that_changes_speed_is_followed_within_a_window() -> None:
    tier = TierSpeed("t")
    for _ in range(WINDOW):
        tier.observe_read(1_000_000, 0.001)  # 1 GB/s
    for _ in range(WINDOW // 2 + 1):
        tier.observe_read(1_000_000, 0.1)  # 10 MB/s now
    assert tier.read_bytes_per_s == pytest.approx(1e7)


def test_priors_before_the_first_sample() -> None:
    assert TierSpeed("t").read_bytes_per_s == PRIOR_READ_BYTES_PER_S
    assert not TierSpeed("t").measured
    speed = PrefillSpeed()
    assert speed.tokens_per_s(1000) == PRIOR_PREFILL_TOKENS_PER_S
    speed.observe(8, 1.0, 8)  # too short to be a speed: fixed cost
    assert speed.tokens_per_s(1000) == PRIOR_PREFILL_TOKENS_PER_S
    with pytest.raises(ValueError, match="prior_tokens_per_s"):
        PrefillSpeed(0.0)


def test_prefill_speed_is_kept_by_prompt_length() -> None:
    speed = PrefillSpeed()
    speed.observe(1000, 0.1, 1000)  # short prompts: 10K tokens/s
    speed.observe(16000, 4.0, 16000)  # long ones: 4K tokens/s (attention)
    assert speed.tokens_per_s(1100) == pytest.approx(10_000)
    assert speed.tokens_per_s(15000) == pytest.approx(4000)
    assert speed.recompute_s(2000, 15000) == pytest.approx(0.5)
    assert speed.tokens_per_s(100_000) == pytest.approx(4000)  # the nearest length measured


def test_short_prefills_do_not_cost_a_long_prompt_per_token() -> None:
    speed = PrefillSpeed()
    speed.observe(64, 0.032, 64)  # a 64-token prompt in 32 ms: mostly fixed cost
    # A 2700-token prompt then costs no more than that prefill: in doubt, recompute is cheap.
    assert speed.recompute_s(2700, 2700) == pytest.approx(0.032)
    assert speed.tokens_per_s(100) == pytest.approx(2000)  # near the sample: its own speed
    speed.observe(2048, 0.2, 2048)  # a long prompt measured: per token from now on
    assert speed.recompute_s(2700, 2700) == pytest.approx(2700 / 10_240)


# -- a real Redis behind a proxy whose latency and bandwidth the test sets --------------------

DELAY_S = 0.1  # long and slow enough that a busy host's scheduling noise is a few %
BYTES_PER_S = 4e6
LAYOUT = KVLayout.mha(num_layers=4, num_kv_heads=8, head_dim=64, dtype=torch.float16)
CHUNK = 64  # 512 KiB a chunk
READS = 8


@pytest.fixture
def throttled(redis_server: RedisProcess) -> Iterator[StorageManager]:
    with DelayProxy(redis_server.port, DELAY_S, bytes_per_s=BYTES_PER_S) as proxy:
        cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.05, remote_url=proxy.url,
                     remote_timeout_secs=10.0, hash_salt="estimates-test")
        sm = StorageManager(cfg, LAYOUT)
        try:
            yield sm
        finally:
            sm.close()


def test_estimates_converge_on_a_tier_whose_speed_is_known(
        throttled: StorageManager) -> None:
    sm = throttled
    keys = make_keys(4 * CHUNK, chunk_size=CHUNK, layout=LAYOUT, seed=5)
    objs = [make_obj(sm.allocator, LAYOUT, k.num_tokens, i) for i, k in enumerate(keys)]
    with lease(objs):
        sm.put(keys, objs)
    assert sm.flush(timeout=60)
    sm.hot.remove(keys)
    redis = sm.lower_tiers[0]
    for _ in range(READS):
        assert redis.batch_contains(keys) == 4  # one round trip
        got = redis.batch_get(keys)  # 2 MiB through the proxy's link
        assert len(got) == 4
        for obj in got:
            obj.release()
    speed = redis.speed
    assert speed.latency_s == pytest.approx(DELAY_S, rel=0.2)
    assert speed.read_bytes_per_s == pytest.approx(BYTES_PER_S, rel=0.2)
