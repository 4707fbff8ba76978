"""What the Redis-tier tests share: a two-segment chunk layout, a put, a check and a count
of hits (the `make_backend` fixture is in conftest.py)."""

from __future__ import annotations

import torch

from kvtier.backends.redis import RedisBackend
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, lease
from tests.helpers import put_random, same_bytes

# 16 tokens x 32 KiB: 512 KiB chunks, stored as two segments with SEGMENT_MB.
MID = KVLayout.mha(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
SEGMENT_MB = 0.25
RECOVERY_DEADLINE = 5.0  # seconds; the bound on coming back, used as a hang bound


def _put(backend: RedisBackend, keys: list[ChunkKey], seed: int = 0) -> list[torch.Tensor]:
    ctx = backend.ctx
    return put_random(backend.batch_put, ctx.allocator, ctx.layout, keys, seed)


def _check(backend: RedisBackend, keys: list[ChunkKey], expected: list[torch.Tensor]) -> None:
    assert backend.batch_contains(keys) == len(keys)
    with lease(backend.batch_get(keys)) as got:
        assert len(got) == len(keys)
        for obj, want in zip(got, expected):
            assert same_bytes(obj.tensor, want)


def _hits(backend: RedisBackend, keys: list[ChunkKey]) -> int:
    with lease(backend.batch_get(keys)) as got:
        return len(got)
