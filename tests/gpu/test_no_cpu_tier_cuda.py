"""`local_cpu: false` on a CUDA pool: chunks read from disk pass through the staging tier in
the transfer arena to the GPU, byte-exact, on the prefetch workers or in a direct load, and
nothing stays staged once the copies have run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector, SGLangMLAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from tests.gpu import cuda

pytestmark = cuda

SLOTS, CHUNK = 1024, 64
HANG_BOUND_S = 60.0  # a bound on a hang, not a timing


def _connector(kind: str, seed: int) -> SGLangMHAConnector | SGLangMLAConnector:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "mla":
        return SGLangMLAConnector([torch.randn(SLOTS, 1, 576, dtype=torch.bfloat16,
                                               device="cuda", generator=gen) for _ in range(3)])
    k = [torch.randn(SLOTS, 8, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
         for _ in range(3)]
    return SGLangMHAConnector(k, [torch.randn_like(t) for t in k])


def _same(a: SGLangMHAConnector | SGLangMLAConnector, sa: torch.Tensor,
          b: SGLangMHAConnector | SGLangMLAConnector, sb: torch.Tensor) -> bool:
    return all(torch.equal(x[sa].view(torch.uint8), y[sb].view(torch.uint8))
               for x, y in zip(a._layers, b._layers))


def _stored(cfg: Config, kind: str, tokens: torch.Tensor, slots: torch.Tensor,
            ) -> SGLangMHAConnector | SGLangMLAConnector:
    """A writer's pool, its `tokens` stored to disk (and not kept in memory)."""
    src = _connector(kind, 1)
    with CacheEngine(cfg, model_name="m", layout=src.layout, connector=src) as writer:
        assert writer.store(tokens, slots) == len(tokens) and writer.flush()
        assert writer.stats()["arena_used_bytes"] == 0
    return src


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_prefetched_load_from_disk_reaches_the_gpu_and_leaves_nothing_staged(
        kind: str, tmp_path: Path) -> None:
    cfg = Config(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
                 local_disk=str(tmp_path), max_local_disk_size=0.5,
                 prefetch_policy="wait_complete")
    n = 5 * CHUNK
    tokens = torch.randint(0, 30000, (n,))
    src_slots = torch.randperm(SLOTS, device="cuda")[:n]
    src = _stored(cfg, kind, tokens, src_slots)
    dst = _connector(kind, 2)
    dst_slots = torch.randperm(SLOTS, device="cuda")[:n]
    engine = CacheEngine(cfg, model_name="m", layout=dst.layout, connector=dst)
    kv = SGLangKVTier(engine, page_size=1)
    try:
        kv.start_prefetch("r", tokens.numpy())
        assert kv._prefetches["r"].wait_done(HANG_BOUND_S) and kv.prefetch_ready("r")
        assert kv.retrieve("r", tokens.numpy(), dst_slots, 0) == n
        torch.cuda.synchronize()
        assert _same(src, src_slots, dst, dst_slots)
        assert engine._device is not None and engine._device.drain(10)
        assert engine.stats()["arena_used_bytes"] == 0
    finally:
        kv.close()
        engine.close()


def test_a_direct_load_from_disk_with_a_tail_is_byte_exact(tmp_path: Path) -> None:
    cfg = Config(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
                 local_disk=str(tmp_path), max_local_disk_size=0.5, save_unfull_chunk=True)
    n = 3 * CHUNK + 17
    tokens = torch.randint(0, 30000, (n,))
    src_slots = torch.randperm(SLOTS, device="cuda")[:n]
    src = _stored(cfg, "mha", tokens, src_slots)
    dst = _connector("mha", 2)
    dst_slots = torch.randperm(SLOTS, device="cuda")[:n]
    with CacheEngine(cfg, model_name="m", layout=dst.layout, connector=dst) as engine:
        assert engine.retrieve(tokens, dst_slots) == n
        torch.cuda.synchronize()
        assert _same(src, src_slots, dst, dst_slots)
        assert engine._device is not None and engine._device.drain(10)
        assert engine.stats()["arena_used_bytes"] == 0
