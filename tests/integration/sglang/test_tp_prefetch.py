"""Two TP ranks (real processes, a real gloo group) admit a request in step although one rank's
prefetch finishes later: every readiness poll is a MIN all-reduce, so neither rank can admit
(and enter the load's collectives) while the other still waits, and nobody deadlocks."""

from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path
from typing import Any

import torch

from harness.redis import free_port
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from tests.helpers import SMALL_MHA

TOKENS = 64
HOLD_POLLS = 20  # rank 1's lower tier answers only after this many readiness polls



def _rank(rank: int, port: int, root: str, out: Any) -> None:
    import torch.distributed as dist

    from kvtier.backends import disk

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    gate = threading.Event()
    if rank == 1:  # this rank's disk reads wait until the test opens the gate
        real = disk.DiskBackend.iter_get

        def held(self: Any, keys: Any) -> Any:
            gate.wait(60)
            yield from real(self, keys)

        disk.DiskBackend.iter_get = held  # type: ignore[method-assign]
    else:
        gate.set()
    cfg = Config(chunk_size=16, max_local_cpu_size=0.01, local_disk=f"{root}/disk{rank}",
                 max_local_disk_size=0.1, prefetch_policy="wait_complete")
    shape = (TOKENS + 1, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim)
    pool = [torch.randn(shape).to(SMALL_MHA.dtype) for _ in range(2 * SMALL_MHA.num_layers)]
    conn = SGLangMHAConnector(pool[::2], pool[1::2])
    engine = CacheEngine(cfg, model_name="m", layout=SMALL_MHA, connector=conn, world_size=2,
                         rank=rank)
    tokens = torch.arange(100, 100 + TOKENS)
    slots = torch.arange(1, TOKENS + 1)
    assert engine.store(tokens, slots) == TOKENS and engine.flush()
    engine.tiers.remove(engine.chunk_keys(tokens), "cpu")

    def reduce_min(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)

    kv = SGLangKVTier(engine, page_size=1, reduce_min=reduce_min)
    kv.start_prefetch("req", tokens.numpy())
    polls = 0
    while not kv.prefetch_ready("req"):
        polls += 1
        if polls == HOLD_POLLS:
            gate.set()
        assert polls < 100_000
    loaded = kv.lookup("req", tokens.numpy())
    out.put((rank, polls, loaded))
    kv.close()
    dist.destroy_process_group()


def test_ranks_admit_in_step_when_one_prefetch_is_late(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    (_, polls0, loaded0), (_, polls1, loaded1) = results
    assert polls0 == polls1 >= HOLD_POLLS  # rank 0 was ready at once, yet waited for rank 1
    assert loaded0 == loaded1 == TOKENS
    assert all(p.exitcode == 0 for p in procs)
