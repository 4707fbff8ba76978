"""What a reader of the store learns from a record: with no key, the prompt (layer 0's V rows
are a per-token function of the token, so open weights turn them back into token ids); with a
record key, nothing of the payload.

The model is the demo model's shape (kvtier.demo.models: vocabulary 512, hidden 64, 2 KV heads
of 16) with random weights, its layer 0 computed as a Llama computes it, in torch: V =
v_proj(RMSNorm(embedding)). The attacker sees only the stored bytes and the weights."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch

from harness.redis import RedisProcess
from kvtier.backends import record
from kvtier.backends.base import StorageBackend
from kvtier.keys import ChunkKey, KeyBuilder
from kvtier.memory import KVLayout, MemoryObj, lease
from tests.backends.keyed import NEW, Store, Tiers, close_all, tier_factory
from tests.helpers import same_bytes

VOCAB, HIDDEN, KV_HEADS, HEAD_DIM = 512, 64, 2, 16
LAYOUT = KVLayout.mha(num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                      dtype=torch.bfloat16)
TOKENS = 16


class OpenModel:
    """The weights layer 0's V depends on, which anyone may download."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen)
        self.norm = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
        self.v_proj = torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=gen) / HIDDEN ** 0.5

    def layer0_v(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), KV_HEADS * HEAD_DIM] in the cache's dtype: no position enters V."""
        x = self.embed[ids]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return (x @ self.v_proj.T).to(LAYOUT.dtype)


def invert(raw: bytes, model: OpenModel) -> list[int]:
    """The attack: the token id of each of layer 0's V rows in a stored record (-1 where no
    vocabulary entry is close), from the raw bytes and the weights alone."""
    hlen = record.header_len(raw)
    shape = struct.unpack_from("<4I", raw, 19)  # the header's shape field: no key needed
    payload = torch.frombuffer(bytearray(raw[hlen:]), dtype=LAYOUT.dtype).reshape(shape)
    rows = torch.nan_to_num(payload[1, 0].float(), nan=1e30, posinf=1e30, neginf=-1e30)
    table = model.layer0_v(torch.arange(VOCAB)).float()
    best = torch.cdist(rows, table, compute_mode="donot_use_mm_for_euclid_dist").min(dim=1)
    return [int(i) if d < 1e-3 else -1 for i, d in zip(best.indices, best.values)]


@pytest.fixture(params=["redis", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path,
          redis_server: RedisProcess) -> Iterator[tuple[Tiers, Store]]:
    redis_server.client().flushall()
    opened: list[StorageBackend] = []
    make = tier_factory(request.param, tmp_path, redis_server, opened)
    yield partial(make, layout=LAYOUT), Store(request.param, tmp_path, redis_server)
    close_all(opened)


def _prompt_chunk(tier: StorageBackend, model: OpenModel, seed: int,
                  ) -> tuple[ChunkKey, list[int], MemoryObj]:
    """A chunk of a random prompt and its KV as an engine would store it: layer 0's V computed
    by the model, the rest random."""
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(seed))
    key = KeyBuilder(model="open-model", fingerprint=LAYOUT.fingerprint(TOKENS),
                     chunk_size=TOKENS).keys(ids)[0]
    obj = tier.ctx.allocate(TOKENS)  # type: ignore[attr-defined]
    assert obj is not None
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    obj.tensor[1, 0] = model.layer0_v(ids)
    return key, ids.tolist(), obj


def test_a_plain_record_gives_the_prompt_back(store: tuple[Tiers, Store]) -> None:
    make, raw = store
    model, tier = OpenModel(), make()
    key, ids, obj = _prompt_chunk(tier, model, seed=1)
    with lease([obj]):
        assert tier.batch_put([key], [obj]) == 1
        v_rows = obj.tensor[1, 0].contiguous().view(torch.uint8).numpy().tobytes()
    stored = raw.read(key)
    assert invert(stored, model) == ids  # every token of the prompt, from bytes and weights
    assert v_rows in stored


def test_an_encrypted_record_gives_nothing_back(store: tuple[Tiers, Store]) -> None:
    make, raw = store
    model, tier = OpenModel(), make(NEW)
    key, ids, obj = _prompt_chunk(tier, model, seed=2)
    with lease([obj]):
        assert tier.batch_put([key], [obj]) == 1
        want = obj.tensor.clone()
        v_rows = obj.tensor[1, 0].contiguous().view(torch.uint8).numpy().tobytes()
    stored = raw.read(key)
    assert len(stored) == record.expected_header_len(key) + LAYOUT.nbytes(TOKENS)
    assert invert(stored, model) == [-1] * TOKENS  # no row is near any token's V
    assert v_rows[:32] not in stored and key.tokens not in stored  # nor any known plaintext
    with lease(tier.batch_get([key])) as got:  # while the key holder loads it byte-exact
        assert len(got) == 1 and same_bytes(got[0].tensor, want)


def test_known_plaintext_is_absent_from_every_stored_byte(store: tuple[Tiers, Store]) -> None:
    """A payload made of the token ids' bytes, repeated: nowhere in the stored record, whose
    bytes look uniformly random."""
    make, raw = store
    tier = make(NEW)
    key, ids, obj = _prompt_chunk(tier, OpenModel(), seed=3)
    pattern = key.tokens * (obj.nbytes // len(key.tokens))
    with lease([obj]):
        obj.byte_view()[:] = pattern
        assert tier.batch_put([key], [obj]) == 1
    body = raw.read(key)[record.expected_header_len(key):]
    assert not any(pattern[i : i + 8] in body for i in range(0, len(key.tokens), 4))
    counts = torch.bincount(torch.frombuffer(bytearray(body), dtype=torch.uint8), minlength=256)
    assert counts.max() < 4 * len(body) / 256  # the plaintext uses 16 token ids' bytes only
