"""Session pins: a session's prefix survives eviction pressure until released, idle or capped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.backends import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.memory import KVLayout, MemoryAllocator, lease
from kvtier.metrics import Counters
from kvtier.sessions import SessionPins
from tests.helpers import SMALL_MHA, make_keys, make_obj

CHUNK = 16
SLOTS = 4096
# A 16-token chunk of this layout is exactly one 4 KiB arena page, so byte caps count chunks.
LAYOUT = KVLayout.mha(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    """An engine whose CPU tier holds 16 chunks (pins capped at half of it)."""
    gen = torch.Generator().manual_seed(0)
    shape = (SLOTS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    k = [torch.randn(shape, generator=gen).to(LAYOUT.dtype) for _ in range(4)]
    v = [torch.randn(shape, generator=gen).to(LAYOUT.dtype) for _ in range(4)]
    assert LAYOUT.nbytes(CHUNK) == 4096
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=16 * 4096 / 1e9,
                 max_session_pinned_fraction=0.5)
    with CacheEngine(cfg, model_name="m", layout=LAYOUT,
                     connector=SGLangMHAConnector(k, v)) as eng:
        yield eng


def _prompt(seed: int, chunks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30_000, (chunks * CHUNK,), generator=gen)


def _slots(n: int) -> torch.Tensor:
    return torch.arange(1, n + 1)


def _flood(engine: CacheEngine, rounds: int = 8) -> None:
    for seed in range(100, 100 + rounds):
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
    # Cap: 8 of the arena's 16 chunks. Three 3-chunk sessions do not fit together.
    sessions = {f"s{i}": _prompt(10 + i, 3) for i in range(3)}
    for sid, ids in sessions.items():
        engine.store(ids, _slots(48), session_id=sid)
    stats = engine.stats()
    assert stats["session_unpins_cap"] >= 1
    assert stats["session_pinned_bytes"] <= stats["session_pinned_cap_bytes"]
    _flood(engine)  # stores never fail for lack of memory: pins stay under the cap
    assert engine.stats().get("store_no_memory", 0) == 0
    assert engine.lookup(sessions["s2"], hot_only=True) == 48  # the newest stays
    assert engine.lookup(sessions["s0"], hot_only=True) == 0  # the oldest went


def test_a_session_larger_than_the_cap_keeps_its_leading_chunks(engine: CacheEngine) -> None:
    big = _prompt(5, 12)
    engine.store(big, _slots(12 * CHUNK), session_id="big")
    stats = engine.stats()
    assert 0 < stats["session_pinned_bytes"] <= stats["session_pinned_cap_bytes"]
    _flood(engine)
    kept = engine.lookup(big, hot_only=True)
    assert 0 < kept < 12 * CHUNK


def test_idle_sessions_are_unpinned_after_the_ttl() -> None:
    now = [0.0]
    arena = MemoryAllocator(64 * 4096)
    cpu = CPUBackend(BackendContext(Config(chunk_size=CHUNK), SMALL_MHA, arena))
    counters = Counters()
    pins = SessionPins(cpu, cap_bytes=1 << 20, ttl_s=60.0, counters=counters,
                       clock=lambda: now[0])
    keys = make_keys(64)
    objs = [make_obj(arena, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
    with lease(objs):
        cpu.batch_put(keys, objs)
    assert pins.pin("s", keys) == 4
    now[0] = 59.0
    pins.touch("s")
    now[0] = 118.0
    assert pins.stats()["sessions_pinned"] == 1  # touched at 59: idle for 59 s only
    now[0] = 120.0
    assert pins.stats()["sessions_pinned"] == 0
    assert counters.snapshot()["session_unpins_ttl"] == 1
    assert cpu.pinned_bytes == 0 and len(cpu.pop_lru(1 << 20)) == 4
