"""`local_cpu: false` on the serving path: no read of a lower tier runs on the scheduler thread.

The adapter (as SGLang's scheduler drives it) asks the CPU tier only; loads from disk/Redis run
on the prefetch workers into a staging tier in the transfer arena, and what was delivered to
the pool is dropped from it, so nothing stays cached in memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from kvtier.keys import ChunkKey
from tests.helpers import SMALL_MHA

TOKENS = 64
HANG_BOUND_S = 60.0  # a bound on a hang, not a timing


def _pool() -> list[torch.Tensor]:
    shape = (TOKENS + 1, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim)
    return [torch.randn(shape).to(SMALL_MHA.dtype) for _ in range(2 * SMALL_MHA.num_layers)]


def _spy_threads(engine: CacheEngine) -> list[str]:
    """The threads that call into the lower tier from now on."""
    (tier,) = engine._storage.lower_tiers
    inner: Any = tier.inner
    seen: list[str] = []
    contains, iter_get = inner.batch_contains, inner.iter_get

    def spied_contains(keys: Sequence[ChunkKey]) -> int:
        seen.append(threading.current_thread().name)
        return contains(keys)

    def spied_iter_get(keys: Sequence[ChunkKey]) -> Iterator[Any]:
        seen.append(threading.current_thread().name)
        yield from iter_get(keys)

    inner.batch_contains, inner.iter_get = spied_contains, spied_iter_get
    return seen


def test_without_a_cpu_tier_loads_run_off_the_scheduler_thread(tmp_path: Path) -> None:
    cfg = Config(chunk_size=16, local_cpu=False, max_local_cpu_size=0.01,
                 local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1,
                 prefetch_policy="wait_complete")
    tokens = torch.arange(100, 100 + TOKENS)
    slots = torch.arange(1, TOKENS + 1)
    source = _pool()
    writer = CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                         connector=SGLangMHAConnector(source[::2], source[1::2]))
    assert writer.store(tokens, slots) == TOKENS and writer.flush()
    assert writer.stats()["arena_used_bytes"] == 0  # stored, and not kept in memory
    writer.close()

    pool = _pool()
    engine = CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                         connector=SGLangMHAConnector(pool[::2], pool[1::2]))
    kv = SGLangKVTier(engine, page_size=1)
    seen = _spy_threads(engine)
    try:
        scheduler = threading.current_thread().name
        assert kv.lookup("req", tokens.numpy()) == 0  # nothing staged yet: no tier asked
        kv.start_prefetch("req", tokens.numpy())
        prefetch = kv.requests.get("req").prefetch
        assert prefetch.wait_done(HANG_BOUND_S)
        assert kv.prefetch_ready("req")
        assert kv.lookup("req", tokens.numpy()) == TOKENS
        assert kv.retrieve("req", tokens.numpy(), slots, 0) == TOKENS
        assert all(torch.equal(a[1:], b[1:]) for a, b in zip(pool, source))
        assert seen and scheduler not in seen  # every lower-tier call ran on a worker
        assert engine.stats()["arena_used_bytes"] == 0  # delivered, so no longer held
    finally:
        kv.close()
        engine.close()


def test_without_a_cpu_tier_a_direct_retrieve_keeps_nothing_staged(tmp_path: Path) -> None:
    cfg = Config(chunk_size=16, local_cpu=False, max_local_cpu_size=0.01,
                 local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1)
    n = TOKENS - 5  # whole chunks and a tail after them
    tokens, slots = torch.arange(100, 100 + n), torch.arange(1, n + 1)
    source = _pool()
    with CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                     connector=SGLangMHAConnector(source[::2], source[1::2])) as writer:
        assert writer.store(tokens, slots) == n and writer.flush()
    pool = _pool()
    with CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                     connector=SGLangMHAConnector(pool[::2], pool[1::2])) as engine:
        assert engine.retrieve(tokens, slots) == n  # read through the staging tier, tail too
        assert all(torch.equal(a[1:n + 1], b[1:n + 1]) for a, b in zip(pool, source))
        assert engine.stats()["arena_used_bytes"] == 0  # nothing left staged


def test_without_a_cpu_tier_a_hits_store_queues_only_what_it_did_not_find(
        tmp_path: Path) -> None:
    """The chunks a request loaded are in a lower tier already: its store (the prompt and
    what followed) queues only the chunks after them, where no CPU tier could tell."""
    cfg = Config(chunk_size=16, local_cpu=False, max_local_cpu_size=0.01,
                 local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1)
    found = 3 * 16
    tokens, slots = torch.arange(100, 100 + TOKENS), torch.arange(1, TOKENS + 1)
    source = _pool()
    with CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                     connector=SGLangMHAConnector(source[::2], source[1::2])) as writer:
        assert writer.store(tokens[:found], slots[:found]) == found and writer.flush()
    pool = _pool()
    engine = CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                         connector=SGLangMHAConnector(pool[::2], pool[1::2]))
    kv = SGLangKVTier(engine, page_size=1)
    counters = engine._storage.counters
    try:
        kv.start_prefetch("req", tokens.numpy())  # staged from the disk, as SGLang admits
        assert kv.requests.get("req").prefetch.wait_done(HANG_BOUND_S) and kv.prefetch_ready("req")
        assert kv.retrieve("req", tokens.numpy(), slots, 0) == found
        job_slots = slots.clone()
        assert kv.submit_store(tokens.numpy(), job_slots, "handle", rid="req")
        assert kv.settle() and engine.flush()
        snap = counters.snapshot(declared=True)
        assert snap["disk.writes"] == 1 and snap["disk.write_present"] == 0  # the 4th chunk
        # Without the load to go by (another request), every chunk is queued again, and the
        # writer finds them there.
        assert kv.submit_store(tokens.numpy(), job_slots, "handle", rid="other")
        assert kv.settle() and engine.flush()
        assert counters.snapshot(declared=True)["disk.write_present"] == 4
    finally:
        kv.close()
        engine.close()
