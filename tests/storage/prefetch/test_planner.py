"""The adaptive prefetch policy: load a hit only when it arrives sooner than its recompute."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.backends import BackendContext
from kvtier.backends.disk import DiskBackend
from kvtier.config import Config
from kvtier.memory import MemoryAllocator
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage import StorageManager
from kvtier.storage.guard import GuardedTier
from kvtier.storage.prefetch.estimates import PRIOR_READ_BYTES_PER_S, PrefillSpeed, TierSpeed
from kvtier.storage.prefetch.handle import Prefetch
from kvtier.storage.prefetch.planner import (
    DEADLINE_FLOOR_S,
    DEADLINE_SLACK,
    Admission,
    Decision,
    LoadPlanner,
    Span,
    decide,
)
from kvtier.storage.prefetch.policy import prefetch_policy
from tests.helpers import SMALL_MHA, make_keys

CHUNK = 16
CHUNK_BYTES = SMALL_MHA.nbytes(CHUNK)


def _tier(latency_s: float, bytes_per_s: float) -> TierSpeed:
    tier = TierSpeed("t")
    tier.observe_latency(latency_s)
    tier.observe_read(10 * CHUNK_BYTES, latency_s + 10 * CHUNK_BYTES / bytes_per_s)
    return tier


def _prefill(tokens_per_s: float) -> PrefillSpeed:
    speed = PrefillSpeed()
    speed.observe(4096, 4096 / tokens_per_s, 4096)
    return speed


def _span(tier: TierSpeed, chunks: int) -> Span:
    return Span(tier, chunks, CHUNK_BYTES, CHUNK)


def test_a_fast_tier_is_loaded_whole() -> None:
    # 1 ms round trip at 10 GB/s against 1000 tokens/s of recompute: loading wins by far.
    got = decide([_span(_tier(0.001, 1e10), 40)], _prefill(1000), 640)
    assert got.chunks == 40 and got.tokens == 640
    assert got.expected_s < got.saved_s
    assert got.expected_s < got.deadline_s <= got.saved_s


def test_a_tier_slower_than_recompute_is_not_loaded() -> None:
    # 200 ms before the first byte, and 640 tokens recompute in 64 ms.
    assert decide([_span(_tier(0.2, 1e10), 40)], _prefill(10_000), 640) == Decision(0, 0, 0, 0)
    # Or no latency but a trickle: each chunk arrives later than it could be recomputed.
    trickle = CHUNK_BYTES / 0.01  # a chunk per 10 ms; recompute: 1.6 ms a chunk
    assert decide([_span(_tier(0.0, trickle), 40)], _prefill(10_000), 640).chunks == 0


def test_a_long_span_repays_a_round_trip_a_short_one_does_not() -> None:
    tier = _tier(0.05, 1e10)  # 50 ms away; recompute 1000 tokens/s = 16 ms a chunk
    assert decide([_span(tier, 2)], _prefill(1000), 32).chunks == 0  # 32 ms < 50 ms
    assert decide([_span(tier, 10)], _prefill(1000), 160).chunks == 10  # 160 ms > 50 ms


def test_a_slow_second_tier_stops_the_load_at_the_fast_tiers_end() -> None:
    fast, slow = _tier(0.0005, 1e10), _tier(0.5, 1e10)
    got = decide([_span(fast, 8), _span(slow, 8)], _prefill(10_000), 256)
    assert got.chunks == 8


def test_loads_queued_on_a_tier_delay_a_new_plan() -> None:
    tier = _tier(0.001, CHUNK_BYTES / 0.001)  # a chunk per ms; recompute 1.6 ms a chunk
    assert decide([_span(tier, 10)], _prefill(10_000), 160).chunks == 10
    tier.queue(1000 * CHUNK_BYTES)  # a second behind other requests' loads
    assert decide([_span(tier, 10)], _prefill(10_000), 160).chunks == 0
    tier.unqueue(1000 * CHUNK_BYTES)
    assert decide([_span(tier, 10)], _prefill(10_000), 160).chunks == 10


def test_the_deadline_never_passes_the_break_even_point() -> None:
    got = Decision(chunks=4, tokens=64, expected_s=0.09, saved_s=0.1)
    assert got.deadline_s == 0.1  # slack would give 0.14: by then recompute was done
    close = Decision(chunks=4, tokens=64, expected_s=0.3, saved_s=0.5)
    assert close.deadline_s == pytest.approx(0.3 * DEADLINE_SLACK + 0.005)  # < 0.5
    # A fast load saving much: a busy host's scheduling noise must not cut it off.
    short = Decision(chunks=4, tokens=64, expected_s=0.01, saved_s=1.0)
    assert short.deadline_s == pytest.approx(0.5)


def test_a_load_of_a_few_milliseconds_survives_a_busy_hosts_noise() -> None:
    # A small prompt from a local tier: 1 ms expected, 8 ms saved. The break-even rule alone
    # would cut it off at 8 ms, which a busy 2-core host's scheduling delay can exceed.
    tiny = Decision(chunks=5, tokens=80, expected_s=0.001, saved_s=0.008)
    assert tiny.deadline_s == DEADLINE_FLOOR_S


def test_a_plan_on_an_unmeasured_tier_is_a_guess() -> None:
    unmeasured = TierSpeed("t")
    unmeasured.observe_latency(0.001)  # its round trips are timed, its reads not yet
    assert not unmeasured.known and 8 * CHUNK_BYTES > 0.001 * PRIOR_READ_BYTES_PER_S
    got = decide([_span(unmeasured, 8)], _prefill(100), 128)
    assert got.chunks == 8 and got.guessed  # the prior says load, but it is a guess
    assert got.deadline_s == pytest.approx(max(got.expected_s * DEADLINE_SLACK + 0.005,
                                               0.5 * got.saved_s))
    assert not decide([_span(_tier(0.02, 1e9), 8)], _prefill(1000), 128).guessed


def test_a_load_whose_time_is_its_round_trips_needs_no_bandwidth() -> None:
    far = TierSpeed("t")
    far.observe_latency(0.02)  # a far tier's round trip is timed, its reads not yet
    small = 8 * CHUNK_BYTES
    assert not far.known and small <= 0.02 * PRIOR_READ_BYTES_PER_S
    assert far.known_for(small) and not far.known_for(100 * small)
    got = decide([_span(far, 8)], _prefill(1000), 128)
    assert got.chunks == 8 and not got.guessed  # waited for: planned on the round trip
    # ... at the prior's slow rate: the bytes cost no more than the round trip itself.
    assert got.expected_s <= 0.02 + small / PRIOR_READ_BYTES_PER_S + 1e-9


def test_hits_on_an_unmeasured_tier_load_in_the_background_and_nobody_waits(
        disk_manager: StorageManager, caplog: pytest.LogCaptureFixture) -> None:
    (disk,) = disk_manager.lower_tiers
    fresh = GuardedTier(disk.inner, Counters("disk.errors"), RateLimitedLog(logging.getLogger()))
    assert not fresh.speed.known
    planner = LoadPlanner(lambda: [fresh], _prefill(1000), SMALL_MHA.nbytes,  # 16 ms a chunk
                          arena_bytes=1 << 30, counters=Counters())
    assert planner.unmeasured() and planner.budget_before_plan_s(32 * CHUNK) == 0.0
    keys = make_keys(32 * CHUNK)
    prefetch = Prefetch(keys, prefetch_policy("adaptive"), budget_s=60.0)
    with caplog.at_level(logging.WARNING):
        assert planner.plan(prefetch, 8) == 32  # every hit, for later requests
    assert prefetch.background and prefetch.deadline <= time.monotonic()
    # the log says why this request recomputes what a tier holds
    assert f"{24 * CHUNK} prompt tokens held by disk are recomputed: its read speed is not " \
        "measured yet" in caplog.text
    # the request goes on at once: its deadline is the plan's own moment, already past
    assert prefetch.ready()
    prefetch.cancel()  # admitted: a background load goes on ...
    assert not prefetch.stopping
    prefetch.cancel(drop=True)  # ... until the request is gone
    assert prefetch.stopping


def _planner_over(*speeds: TierSpeed, counters: Counters | None = None) -> LoadPlanner:
    tiers = [SimpleNamespace(speed=s, name=s.name) for s in speeds]  # admission reads speeds
    return LoadPlanner(lambda: tiers, _prefill(1000), SMALL_MHA.nbytes,  # type: ignore[arg-type]
                       arena_bytes=1 << 30, counters=counters or Counters())


def test_a_tier_whose_round_trip_exceeds_the_recompute_is_left_out_of_the_budget() -> None:
    far = TierSpeed("far")
    far.observe_latency(5.0)  # its reads never timed: records too small, or none read yet
    assert planner_admission(_planner_over(far)) == Admission(0.0, "slower_than_recompute",
                                                                 False)
    near = TierSpeed("near")
    near.observe_latency(0.001)  # might pay, not measured yet: a guess, in the background
    assert planner_admission(_planner_over(near, far)) == Admission(0.0, "unmeasured", True)
    disk = _tier(0.001, 1e9)  # measured: a request may wait what a load from it could save
    got = planner_admission(_planner_over(disk, near, far))
    assert 0 < got.budget_s <= 1.0 and got.reason == "deadline" and got.guessing


def test_the_lookup_round_trip_counts_in_a_tiers_best_case() -> None:
    """One round trip (0.6 s) is less than the recompute (1 s), but the lookup and the read
    take one each: the tier cannot pay, and no request waits for it (issue 67: a far Redis
    held every request for a lookup that could never be repaid)."""
    far = _tier(0.6, 1e12)
    assert planner_admission(_planner_over(far)) == Admission(0.0, "slower_than_recompute",
                                                                 False)
    near = _tier(0.1, 1e12)
    transfer = SMALL_MHA.nbytes(1000) / near.read_bytes_per_s
    assert planner_admission(_planner_over(near)).budget_s == pytest.approx(1.0 - 0.2 - transfer)


def test_a_tier_whose_lookups_keep_missing_is_not_waited_for() -> None:
    """A miss costs the lookup's round trip for nothing: a 100 ms tier whose recent lookups
    all missed is not worth it; a 0.5 ms one still is; hits bring the far one back."""
    far, near = _tier(0.1, 1e12), _tier(0.0005, 1e12)
    assert far.hit_rate == 0.5  # not asked yet: worth waiting for while a hit saves more
    assert planner_admission(_planner_over(far)).budget_s > 0
    for _ in range(16):
        far.observe_lookup(False)
        near.observe_lookup(False)
    assert far.hit_rate == pytest.approx(1 / 18)
    assert planner_admission(_planner_over(far)) == Admission(0.0, "slower_than_recompute",
                                                                 False)
    assert planner_admission(_planner_over(near)).budget_s > 0.9
    for _ in range(4):
        far.observe_lookup(True)
    assert planner_admission(_planner_over(far)).budget_s > 0.7


def test_a_tiers_recent_answers_stand_in_for_its_lookup(tmp_path: Path) -> None:
    """Remembered to hold the first chunk: no lookup round trip in the best case; remembered
    to lack it: the tier adds nothing to the wait."""
    cfg = Config(chunk_size=CHUNK, local_disk=str(tmp_path / "d"), max_local_disk_size=0.1)
    inner = DiskBackend(BackendContext(config=cfg, layout=SMALL_MHA,
                                       allocator=MemoryAllocator(1 << 20)))
    disk = GuardedTier(inner, Counters("disk.errors"), RateLimitedLog(logging.getLogger()))
    try:
        disk.speed.observe_latency(0.2)
        disk.speed.observe_read(10**6, 0.2 + 10**6 / 1e12)
        planner = LoadPlanner(lambda: [disk], _prefill(1000), SMALL_MHA.nbytes,
                              arena_bytes=1 << 30, counters=Counters())
        keys = make_keys(1000)
        transfer = SMALL_MHA.nbytes(1000) / disk.speed.read_bytes_per_s
        asked = planner.admission(1000, keys).budget_s
        assert asked == pytest.approx(1.0 - 0.4 - transfer)
        disk.existence.remember(keys, 1)
        assert planner.admission(1000, keys).budget_s == pytest.approx(1.0 - 0.2 - transfer)
        disk.existence.remember(keys, 0)
        assert planner.admission(1000, keys).budget_s == 0.0
    finally:
        disk.close()


def test_a_plan_records_whether_each_tier_it_asked_held_the_prompt(
        disk_manager: StorageManager) -> None:
    sm = disk_manager
    sm.prefill.observe(4096, 4096 / 100.0, 4096)
    (tier,) = sm.lower_tiers
    before = tier.speed.hit_rate
    _settled(sm, make_keys(32 * CHUNK, seed=99))  # stored nowhere
    assert tier.speed.hit_rate < before
    after_miss = tier.speed.hit_rate
    _settled(sm, make_keys(32 * CHUNK))  # stored on the disk
    assert tier.speed.hit_rate > after_miss


def planner_admission(planner: LoadPlanner) -> Admission:
    return planner.admission(1000)  # 1 s of recompute at 1000 tokens/s


def test_a_plan_made_after_its_request_was_admitted_counts_no_wait() -> None:
    counters = Counters()
    near = TierSpeed("near")
    near.observe_latency(0.001)
    planner = _planner_over(near, counters=counters)
    keys = make_keys(32 * CHUNK)
    prefetch = Prefetch(keys, prefetch_policy("adaptive"), budget_s=0.0)
    prefetch.unwaited = planner.admission(32 * CHUNK).reason
    prefetch.cancel()  # admitted at once; then its store filled the CPU tier ...
    assert planner.plan(prefetch, 32) == 32  # ... before the worker planned the load
    prefetch.finish(32)
    stats = counters.snapshot(declared=True)
    assert stats["adaptive_tokens_recomputed_unmeasured"] == 32 * CHUNK
    assert stats["adaptive_tokens_recomputed_deadline"] == 0  # it never waited
    assert stats["adaptive_tokens_loaded"] == 0


# -- the policy on a storage manager, with a real disk tier ----------------------------------


@pytest.fixture
def disk_manager(disk_with_chunks: Callable[[int], StorageManager]) -> StorageManager:
    """CPU tier (policy adaptive) over a disk tier holding 32 chunks; the first 8 also in the
    CPU tier."""
    return disk_with_chunks(8)


def _settled(sm: StorageManager, keys: list, timeout: float = 30) -> int:
    prefetch = sm.start_prefetch(keys)
    assert prefetch.wait_done(timeout)
    return prefetch.result()


def test_a_disk_faster_than_recompute_is_loaded(disk_manager: StorageManager) -> None:
    sm = disk_manager
    sm.prefill.observe(4096, 4096 / 100.0, 4096)  # a slow engine: 100 tokens/s
    keys = make_keys(32 * CHUNK)
    assert _settled(sm, keys) == 32
    stats = sm.stats()
    assert stats["adaptive_tokens_loaded"] == 32 * CHUNK
    assert stats["disk.est_read_bytes_per_second"] > 0


def test_cpu_hits_are_used_and_a_slow_tier_is_not(disk_manager: StorageManager) -> None:
    sm = disk_manager
    sm.prefill.observe(4096, 4096 / 1e9, 4096)  # recompute is (almost) free
    keys = make_keys(32 * CHUNK)
    prefetch = sm.start_prefetch(keys)
    assert prefetch.wait_done(30) and prefetch.result() == 8  # the CPU part only
    assert prefetch.ready()
    assert sm.hot.batch_contains(keys) == 8
    stats = sm.stats()
    assert stats["adaptive_tokens_loaded"] == 8 * CHUNK
    assert stats["adaptive_tokens_recomputed_slower_than_recompute"] == 24 * CHUNK


def test_tokens_no_tier_holds_count_as_misses(disk_manager: StorageManager) -> None:
    sm = disk_manager
    sm.prefill.observe(4096, 4096 / 100.0, 4096)
    keys = make_keys(40 * CHUNK)  # 8 more than were stored
    assert _settled(sm, keys) == 32
    assert sm.stats()["adaptive_tokens_recomputed_miss"] == 8 * CHUNK


def test_before_a_tier_is_measured_nobody_waits_for_a_plan(tmp_path: Path) -> None:
    cfg = Config(chunk_size=CHUNK, local_disk=str(tmp_path / "d"), max_local_disk_size=0.1)
    alloc = MemoryAllocator(1 << 20)
    inner = DiskBackend(BackendContext(config=cfg, layout=SMALL_MHA, allocator=alloc))
    disk = GuardedTier(inner, Counters("disk.errors"), RateLimitedLog(logging.getLogger()))
    try:
        planner = LoadPlanner(lambda: [disk], _prefill(1000), SMALL_MHA.nbytes,
                              arena_bytes=1 << 30, counters=Counters())
        assert planner.budget_before_plan_s(1000) == 0.0
        disk.speed.observe_latency(0.01)  # a round trip timed, no read yet: still a guess
        assert planner.budget_before_plan_s(1000) == 0.0
        disk.speed.observe_read(10**6, 0.01 + 10**6 / 1e9)  # ~1 GB/s
        # What a load of it all could save: recompute less the lookup's and the read's round
        # trips and the bytes.
        expected = 1.0 - 2 * 0.01 - SMALL_MHA.nbytes(1000) / disk.speed.read_bytes_per_s
        assert planner.budget_before_plan_s(1000) == pytest.approx(expected)
        disk.speed.observe_latency(5.0)
        disk.speed.observe_latency(5.0)  # now 5 s away (the median): nothing to wait for
        assert planner.budget_before_plan_s(1000) == 0.0
    finally:
        disk.close()


def test_a_tier_is_timed_when_it_is_built(tmp_path: Path) -> None:
    sm = StorageManager(Config(chunk_size=CHUNK, max_local_cpu_size=0.008,
                               local_disk=str(tmp_path / "d"), max_local_disk_size=0.1),
                        SMALL_MHA)
    try:
        (disk,) = sm.lower_tiers
        deadline = time.monotonic() + 30.0  # a bound on a hang, never expected to pass
        while not disk.speed.latency_measured and time.monotonic() < deadline:
            time.sleep(0.01)
        assert disk.speed.latency_measured  # a round trip off any request's path
        assert sm.stats()["disk.errors"] == 0
    finally:
        sm.close()


def test_a_request_waits_no_longer_than_recomputing_its_prompt(tmp_path: Path) -> None:
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.008)  # no lower tier at all
    sm = StorageManager(cfg, SMALL_MHA)
    try:
        sm.prefill.observe(4096, 4096 / 1000.0, 4096)
        keys = make_keys(8 * CHUNK)
        prefetch = sm.start_prefetch(keys)
        # Before its plan the budget is the prompt's recompute time: no load can win later.
        tokens = 8 * CHUNK
        budget = prefetch_policy("adaptive").budget_s(cfg.prefetch, tokens,
                                                      sm.prefill.recompute_s(tokens, tokens))
        assert budget == pytest.approx(tokens / 1000.0)
        assert prefetch.wait_done(30) and prefetch.ready(now=time.monotonic())
        assert prefetch.deadline <= time.monotonic()  # nothing to load: ready at once
    finally:
        sm.close()
