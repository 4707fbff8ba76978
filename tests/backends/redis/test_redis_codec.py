"""`remote_serde` in the Redis tier, against a real redis-server: fp8 records are small and
close, naive stays exact, readers of either codec load both, sealed fp8 round-trips and a
tampered one is a counted miss."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from harness.redis import RedisProcess
from kvtier.backends.codec import FP8
from kvtier.backends.redis import RedisBackend
from kvtier.backends.redis.io import redis_keys
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryObj, lease
from tests.backends.test_codec import kv_like, rel_l2
from tests.helpers import make_keys, same_bytes

BF16 = KVLayout.mha(num_layers=4, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
FP32 = KVLayout.mha(num_layers=4, num_kv_heads=3, head_dim=64, dtype=torch.float32)
TOKENS = 256


def _store(tier: RedisBackend, keys: list[ChunkKey]) -> list[torch.Tensor]:
    objs = [kv_like(tier.ctx.allocator, tier.ctx.layout, k.num_tokens, i)
            for i, k in enumerate(keys)]
    want = [o.tensor.clone() for o in objs]
    with lease(objs):
        assert tier.batch_put(keys, objs) == len(keys)
    return want


def _load(tier: RedisBackend, keys: list[ChunkKey]) -> list[torch.Tensor]:
    objs: list[MemoryObj] = tier.batch_get(keys)
    with lease(objs):
        return [o.tensor.clone() for o in objs]


def _stored_bytes(server: RedisProcess) -> int:
    client = server.client()
    return sum(int(client.strlen(k)) for k in client.keys("*"))


@pytest.mark.parametrize(("layout", "ratio"), [(BF16, 0.55), (FP32, 0.3)])
def test_fp8_records_are_small_and_close_and_naive_is_exact(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend], layout: KVLayout,
    ratio: float,
) -> None:
    client = redis_server.client()
    keys = make_keys(2 * TOKENS, chunk_size=TOKENS, layout=layout)
    sizes, loaded = {}, {}
    for serde in ("naive", "fp8"):
        client.flushall()
        tier = make_backend(redis_server.url, layout=layout, remote_serde=serde)
        want = _store(tier, keys)
        sizes[serde] = _stored_bytes(redis_server)
        loaded[serde] = _load(tier, keys)
    assert sizes["fp8"] <= ratio * sizes["naive"]
    assert all(same_bytes(a, b) for a, b in zip(want, loaded["naive"], strict=True))
    for a, b in zip(want, loaded["fp8"], strict=True):
        err = rel_l2(a, b)
        assert float(err.max()) < 0.06 and float(err.min()) > 0  # lossy, within 6% per layer


def test_readers_of_either_codec_load_records_of_both(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    redis_server.client().flushall()
    keys = make_keys(3 * 64, chunk_size=64, layout=BF16)
    fp8 = make_backend(redis_server.url, layout=BF16, remote_serde="fp8")
    int8 = make_backend(redis_server.url, layout=BF16, remote_serde="int8")
    naive = make_backend(redis_server.url, layout=BF16)
    # chunk 0 fp8, chunk 1 int8, chunk 2 naive
    want = _store(fp8, keys[:1]) + _store(int8, keys[1:2]) + _store(naive, keys[2:])
    for reader in (naive, fp8, int8):
        got = _load(reader, keys)
        assert len(got) == 3 and same_bytes(got[2], want[2])
        assert all(float(rel_l2(a, b).max()) < 0.06 for a, b in zip(want, got, strict=True))


def test_segmented_fp8_records_keep_the_naive_key_count(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    redis_server.client().flushall()
    keys = make_keys(TOKENS, chunk_size=TOKENS, layout=BF16)
    seg = 0.125  # MiB: a naive chunk (768 KiB) in 6 keys, an fp8 one in 6 even pieces
    fp8 = make_backend(redis_server.url, layout=BF16, remote_serde="fp8", remote_segment_mb=seg)
    want = _store(fp8, keys)
    assert len(redis_server.client().keys("*")) == 6
    naive = make_backend(redis_server.url, layout=BF16, remote_segment_mb=seg)
    got = _load(naive, keys)
    assert len(got) == 1 and float(rel_l2(want[0], got[0]).max()) < 0.06
    assert naive.stats()["segment_mismatches"] == 0


def test_sealed_fp8_round_trips_and_a_tampered_record_is_a_counted_miss(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend], tmp_path: Path,
) -> None:
    client = redis_server.client()
    client.flushall()
    key_file = tmp_path / "record.key"
    key_file.write_bytes(b"a codec-test record secret, 32 bytes!\n")
    key_file.chmod(0o600)
    tier = make_backend(redis_server.url, layout=BF16, remote_serde="fp8",
                        record_key_file=str(key_file))
    keys = make_keys(2 * 64, chunk_size=64, layout=BF16)
    want = _store(tier, keys)
    got = _load(tier, keys)
    assert len(got) == 2 and all(float(rel_l2(a, b).max()) < 0.06
                                 for a, b in zip(want, got, strict=True))
    assert sum(int(client.strlen(k)) for k in client.keys("*")) < 0.55 * 2 * BF16.nbytes(64)
    name = redis_keys(keys[0], 1)[0]
    value = bytearray(client.get(name))
    value[-3] ^= 0x40  # a bit of the ciphertext (the scales' end)
    client.set(name, bytes(value))
    corrupt = tier.stats()["corrupt"]
    # the checksum over the stored (encrypted, compressed) bytes fails: a counted miss
    assert _load(tier, keys) == []
    assert tier.stats()["corrupt"] == corrupt + 1 and client.get(name) is None  # deleted


def test_a_probe_moves_the_codecs_bytes_and_reports_the_decoded_ones(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    client = redis_server.client()
    nbytes = BF16.nbytes(TOKENS)
    sent = {}
    for serde in ("naive", "fp8"):
        tier = make_backend(redis_server.url, layout=BF16, remote_serde=serde)  # chunks of 16
        before = int(client.info("stats")["total_net_output_bytes"])
        (sample,) = tier.probe(nbytes)
        sent[serde] = int(client.info("stats")["total_net_output_bytes"]) - before
        assert sample.read_bytes == nbytes  # what the planner plans in: decoded bytes
    ratio = FP8.payload_nbytes(BF16, 16) / BF16.nbytes(16)  # 0.57: the scales of 16 tokens
    assert nbytes <= sent["naive"] < 1.05 * nbytes
    assert ratio * nbytes <= sent["fp8"] < (ratio + 0.05) * nbytes
