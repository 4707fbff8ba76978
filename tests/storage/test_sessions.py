"""Session pins: a session's prefix survives eviction pressure until released, idle or capped,
and one session's long prompt costs neither other sessions nor ordinary requests their room."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvtier.backends import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.memory import KVLayout, MemoryAllocator, lease
from kvtier.metrics import Counters
from kvtier.storage.sessions import MAX_PINNED_FRACTION, SessionPins
from tests.helpers import SMALL_MHA, make_keys, make_obj

CHUNK = 16
SLOTS = 4096
ARENA_CHUNKS = 32
# A 16-token chunk of this layout is exactly one 4 KiB arena page, so byte caps count chunks.
LAYOUT = KVLayout.mha(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
PAGE = 4096


@contextmanager
def _engine(fraction: float) -> Iterator[CacheEngine]:
    """An engine whose CPU tier holds `ARENA_CHUNKS` chunks, `fraction` of it for pins."""
    gen = torch.Generator().manual_seed(0)
    shape = (SLOTS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    k = [torch.randn(shape, generator=gen).to(LAYOUT.dtype) for _ in range(4)]
    v = [torch.randn(shape, generator=gen).to(LAYOUT.dtype) for _ in range(4)]
    assert LAYOUT.nbytes(CHUNK) == PAGE
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=ARENA_CHUNKS * PAGE / 1e9,
                 max_session_pinned_fraction=fraction)
    with CacheEngine(cfg, model_name="m", layout=LAYOUT,
                     connector=SGLangMHAConnector(k, v)) as eng:
        yield eng


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    """Pins capped at 16 chunks, 4 chunks per session."""
    with _engine(0.5) as eng:
        assert eng._storage.sessions.quota_bytes == 4 * PAGE
        yield eng


def _prompt(seed: int, chunks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30_000, (chunks * CHUNK,), generator=gen)


def _slots(n: int) -> torch.Tensor:
    return torch.arange(1, n + 1)


_FLOOD_SEEDS = itertools.count(100)


def _flood(engine: CacheEngine, rounds: int = 12) -> None:
    """Store more unrelated chunks than the arena holds: everything unpinned is evicted (fresh
    prompts each time: under `arc`, prompts seen before would join the main segment)."""
    for seed in itertools.islice(_FLOOD_SEEDS, rounds):
        engine.store(_prompt(seed, 4), _slots(4 * CHUNK))


def test_pinned_session_survives_eviction_pressure_until_released(engine: CacheEngine) -> None:
    turn, other = _prompt(1, 4), _prompt(2, 4)
    engine.store(turn, _slots(64), session_id="s1")
    engine.store(other, _slots(64))
    _flood(engine)
    assert engine.lookup(turn, hot_only=True) == 64  # pinned: still in the CPU tier
    assert engine.lookup(other, hot_only=True) == 0  # not pinned: evicted
    assert engine.stats()["sessions_pinned"] == 1
    assert engine.release_session("s1")
    assert not engine.release_session("s1")
    _flood(engine)
    assert engine.lookup(turn, hot_only=True) == 0
    assert engine.stats()["session_releases"] == 1


def test_next_turn_replaces_the_previous_pins(engine: CacheEngine) -> None:
    first = _prompt(1, 2)
    second = torch.cat([first, _prompt(3, 2)])
    engine.store(first, _slots(32), session_id="s")
    engine.store(second, _slots(64), session_id="s")
    pinned = engine.stats()["session_pinned_bytes"]
    assert pinned == 4 * LAYOUT.nbytes(CHUNK)  # the 4 chunks of the latest turn, once
    _flood(engine)
    assert engine.lookup(second, hot_only=True) == 64


def test_over_the_cap_the_least_recently_used_session_is_unpinned(engine: CacheEngine) -> None:
    # Cap: 16 chunks. Five sessions of 4 chunks, each within its quota, do not fit together.
    sessions = {f"s{i}": _prompt(10 + i, 4) for i in range(5)}
    for sid, ids in sessions.items():
        engine.store(ids, _slots(64), session_id=sid)
    stats = engine.stats()
    assert stats["session_unpins_cap"] == 1
    assert stats["session_pinned_bytes"] <= stats["session_pinned_cap_bytes"]
    _flood(engine)  # stores never fail for lack of memory: pins stay under the cap
    assert engine.stats().get("store_no_memory", 0) == 0
    for sid in ("s1", "s2", "s3", "s4"):
        assert engine.lookup(sessions[sid], hot_only=True) == 64
    assert engine.lookup(sessions["s0"], hot_only=True) == 0  # the oldest went


def test_a_session_longer_than_its_quota_keeps_its_leading_chunks(engine: CacheEngine) -> None:
    big = _prompt(5, 12)
    engine.store(big, _slots(12 * CHUNK), session_id="big")
    stats = engine.stats()
    assert stats["session_pinned_bytes"] == engine._storage.sessions.quota_bytes
    assert stats["session_unpins_quota"] == 1
    _flood(engine)
    assert engine.lookup(big, hot_only=True) == 4 * CHUNK  # its quota, from the front


def test_a_long_prompt_costs_neither_the_other_session_nor_ordinary_requests() -> None:
    # The issue: with a large pin fraction, one session's long prompt unpinned every other
    # session and left ordinary requests without room. At the largest fraction allowed (0.8:
    # 25.6 chunks of 32), each session pins at most a quarter of that (6 chunks).
    with _engine(MAX_PINNED_FRACTION) as engine:
        assert engine._storage.sessions.quota_bytes // PAGE == 6
        chat, agent = _prompt(1, 6), _prompt(2, 20)
        engine.store(chat, _slots(6 * CHUNK), session_id="chat")
        engine.store(agent, _slots(20 * CHUNK), session_id="agent")  # the long prompt
        ordinary = _prompt(3, 16)  # half the arena, more than what the pins leave in reserve
        assert engine.store(ordinary, _slots(16 * CHUNK)) == 16 * CHUNK  # stored whole
        # The agent's next turn is longer still: it trims itself again, never the chat.
        engine.store(torch.cat([agent, _prompt(4, 4)]), _slots(24 * CHUNK), session_id="agent")
        _flood(engine)
        stats = engine.stats()
        assert stats.get("store_no_memory", 0) == 0
        assert stats.get("session_unpins_cap", 0) == 0 and stats["session_unpins_quota"] >= 1
        assert engine.lookup(chat, hot_only=True) == 6 * CHUNK  # all of it, still pinned
        assert engine.lookup(agent, hot_only=True) == 6 * CHUNK  # its quota's worth


def _cpu_with(n_tokens: int, arena_bytes: int = 64 * 4096,
              seed: int = 0) -> tuple[CPUBackend, MemoryAllocator, list]:
    arena = MemoryAllocator(arena_bytes)
    cpu = CPUBackend(BackendContext(Config(chunk_size=CHUNK), SMALL_MHA, arena))
    keys = make_keys(n_tokens, seed=seed)
    objs = [make_obj(arena, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
    with lease(objs):
        cpu.batch_put(keys, objs)
    return cpu, arena, keys


def test_the_cap_is_clamped_to_leave_the_tier_headroom() -> None:
    cpu, arena, _ = _cpu_with(16)
    pins = SessionPins(cpu, cap_bytes=arena.size, ttl_s=60.0, counters=Counters(),
                       arena_bytes=arena.size)
    assert pins.cap_bytes == int(MAX_PINNED_FRACTION * arena.size)
    assert pins.quota_bytes == pins.cap_bytes // 4


def test_a_chunk_two_sessions_share_stays_pinned_until_both_let_go() -> None:
    cpu, _, keys = _cpu_with(64)
    pins = SessionPins(cpu, cap_bytes=1 << 20, ttl_s=60.0, counters=Counters())
    assert pins.pin("a", keys) == 4 and pins.pin("b", keys[:2]) == 2
    pinned = cpu.pinned_bytes
    assert pins.release("a")
    assert cpu.pinned_bytes == pinned // 2  # b's two chunks are still pinned
    assert [k for k, _ in cpu.pop_lru(1 << 20)] == [keys[3], keys[2]]
    assert pins.release("b")
    assert cpu.pinned_bytes == 0 and len(cpu.pop_lru(1 << 20)) == 2


def test_idle_sessions_are_unpinned_after_the_ttl() -> None:
    now = [0.0]
    cpu, _, keys = _cpu_with(64)
    counters = Counters()
    pins = SessionPins(cpu, cap_bytes=1 << 20, ttl_s=60.0, counters=counters,
                       clock=lambda: now[0])
    assert pins.pin("s", keys) == 4
    now[0] = 59.0
    pins.touch("s")
    now[0] = 118.0
    assert pins.stats()["sessions_pinned"] == 1  # touched at 59: idle for 59 s only
    now[0] = 120.0
    assert pins.stats()["sessions_pinned"] == 0
    assert counters.snapshot()["session_unpins_ttl"] == 1
    assert cpu.pinned_bytes == 0 and len(cpu.pop_lru(1 << 20)) == 4


def test_a_retained_prefix_expires_at_its_own_time_and_retaining_again_restarts_it() -> None:
    now = [0.0]
    cpu, _, keys = _cpu_with(64)
    counters = Counters()
    pins = SessionPins(cpu, cap_bytes=1 << 20, ttl_s=600.0, counters=counters,
                       clock=lambda: now[0])
    assert pins.retain("short", keys[:2], 10.0) == 2
    assert pins.retain("long", keys, 30.0) == 4
    now[0] = 10.0
    assert pins.stats()["retained_prefixes"] == 1  # "short" is over, "long" is not
    assert counters.snapshot()["retain_expiries"] == 1
    now[0] = 25.0
    assert pins.retain("long", keys, 30.0) == 4  # renewed at 25: until 55
    now[0] = 54.0
    assert pins.stats()["retained_prefixes"] == 1
    now[0] = 55.0
    assert pins.stats()["retained_prefixes"] == 0
    assert counters.snapshot()["retain_expiries"] == 2
    assert cpu.pinned_bytes == 0 and len(cpu.pop_lru(1 << 20)) == 4


def test_over_the_cap_sessions_go_before_retained_prefixes() -> None:
    cpu, arena, keys = _cpu_with(64)
    counters = Counters()
    # Room for 4 chunks in all, 4 per pin (quota share 1).
    pins = SessionPins(cpu, cap_bytes=4 * SMALL_MHA.nbytes(CHUNK), ttl_s=600.0, counters=counters,
                       session_share=1.0)
    assert pins.retain("r", keys[:2], 60.0) == 2
    assert pins.pin("s", keys[2:4]) == 2
    other = make_keys(2 * CHUNK, seed=77)
    with lease([make_obj(arena, SMALL_MHA, CHUNK, i) for i in range(2)]) as objs:
        cpu.batch_put(other, objs)
    assert pins.retain("r2", other, 60.0) == 2  # over the cap: the session goes first
    stats = pins.stats()
    assert stats["sessions_pinned"] == 0 and stats["retained_prefixes"] == 2
    assert counters.snapshot()["session_unpins_cap"] == 1


@pytest.mark.parametrize("tenant_share", [0.5, 1.0])
def test_a_tenants_flood_of_retain_hints_unpins_its_own_pins_first(tenant_share: float) -> None:
    """A tenant over its share of the pin cap loses its own pins to the cap before a tenant
    within its share loses any; with the share off, sessions go first, whoever holds them."""
    cpu, arena, keys = _cpu_with(64)
    pins = SessionPins(cpu, cap_bytes=4 * SMALL_MHA.nbytes(CHUNK), ttl_s=600.0,
                       counters=Counters(), session_share=1.0, tenant_share=tenant_share)
    quiet = [k._replace(salt="quiet") for k in keys[:2]]
    assert pins.pin("chat", quiet) == 2  # within its share: 2 of the 4 chunks
    for seed in (77, 78):
        noisy = [k._replace(salt="noisy") for k in make_keys(2 * CHUNK, seed=seed)]
        with lease([make_obj(arena, SMALL_MHA, CHUNK, i) for i in range(2)]) as objs:
            cpu.batch_put(noisy, objs)
        assert pins.retain(f"agent-{seed}", noisy, 60.0) == 2
    stats = pins.stats()
    if tenant_share < 1.0:  # the noisy tenant's older retained prefix went
        assert stats["sessions_pinned"] == 1 and stats["retained_prefixes"] == 1
    else:
        assert stats["sessions_pinned"] == 0 and stats["retained_prefixes"] == 2
