"""`remote_serde` in the disk tier: fp8 record files are small and close, naive stays exact,
either codec's reader loads both (also after a restart), sealed fp8 round-trips, a plain one
is decoded piece by piece as a whole payload decodes, and a tampered record is a counted miss."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvtier.backends import BackendContext
from kvtier.backends.codec import FP8, ScaledCodec
from kvtier.backends.disk import DiskBackend
from kvtier.backends.disk import files as record_files
from kvtier.backends.record import expected_header_len
from kvtier.config import Config
from kvtier.kernels import ops
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease
from tests.backends.disk.disk_helpers import _files
from tests.backends.test_codec import kv_like, rel_l2
from tests.helpers import make_keys, same_bytes

BF16 = KVLayout.mha(num_layers=4, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
FP32 = KVLayout.mha(num_layers=4, num_kv_heads=3, head_dim=64, dtype=torch.float32)
TOKENS = 256

Open = Callable[..., DiskBackend]


@pytest.fixture
def open_tier(tmp_path: Path) -> Iterator[Open]:
    """`open(root, layout, serde, **config)` -> a disk tier with its own arena, checked and
    closed after the test."""
    opened: list[DiskBackend] = []

    def _open(root: Path, layout: KVLayout = BF16, serde: str = "naive",
              **cfg: object) -> DiskBackend:
        config = Config(chunk_size=TOKENS, max_local_cpu_size=0.032, local_disk=str(root),
                        max_local_disk_size=0.1, remote_serde=serde,
                        **cfg)  # type: ignore[arg-type]
        alloc = MemoryAllocator(32 << 20)
        opened.append(DiskBackend(BackendContext(config=config, layout=layout,
                                                 allocator=alloc)))
        return opened[-1]

    yield _open
    for tier in opened:
        tier.check_integrity()
        tier.close()
        assert tier.ctx.allocator.used_bytes == 0


def _store(tier: DiskBackend, keys: list[ChunkKey]) -> list[torch.Tensor]:
    objs = [kv_like(tier.ctx.allocator, tier.ctx.layout, k.num_tokens, i)
            for i, k in enumerate(keys)]
    want = [o.tensor.clone() for o in objs]
    with lease(objs):
        assert tier.batch_put(keys, objs) == len(keys)
    return want


def _load(tier: DiskBackend, keys: list[ChunkKey]) -> list[torch.Tensor]:
    objs: list[MemoryObj] = tier.batch_get(keys)
    with lease(objs):
        return [o.tensor.clone() for o in objs]


@pytest.mark.parametrize(("layout", "ratio"), [(BF16, 0.55), (FP32, 0.3)])
def test_fp8_files_are_small_and_close_and_naive_is_exact(
        open_tier: Open, tmp_path: Path, layout: KVLayout, ratio: float) -> None:
    keys = make_keys(2 * TOKENS, chunk_size=TOKENS, layout=layout)
    sizes, loaded = {}, {}
    for serde in ("naive", "fp8"):
        tier = open_tier(tmp_path / serde, layout, serde)
        want = _store(tier, keys)
        sizes[serde] = sum(p.stat().st_size for p in _files(tmp_path / serde))
        assert tier.stats()["bytes"] == sizes[serde]  # the cap counts what the files hold
        loaded[serde] = _load(tier, keys)
    assert sizes["fp8"] <= ratio * sizes["naive"]
    assert all(same_bytes(a, b) for a, b in zip(want, loaded["naive"], strict=True))
    for a, b in zip(want, loaded["fp8"], strict=True):
        err = rel_l2(a, b)
        assert float(err.max()) < 0.06 and float(err.min()) > 0


def test_either_reader_loads_both_codecs_after_a_restart(open_tier: Open,
                                                         tmp_path: Path) -> None:
    root = tmp_path / "disk"
    keys = make_keys(3 * 64, chunk_size=64, layout=BF16)
    fp8 = open_tier(root, serde="fp8")
    want = _store(fp8, keys[:2])
    fp8.close()
    naive = open_tier(root)
    want += _store(naive, keys[2:])  # chunks 0-1 fp8, chunk 2 naive, in one directory
    naive.close()
    for serde in ("naive", "fp8"):
        got = _load(open_tier(root, serde=serde), keys)
        assert len(got) == 3 and same_bytes(got[2], want[2])
        assert all(float(rel_l2(a, b).max()) < 0.06 for a, b in zip(want, got, strict=True))


def test_sealed_fp8_round_trips_and_a_tampered_file_is_a_counted_miss(
        open_tier: Open, tmp_path: Path) -> None:
    key_file = tmp_path / "record.key"
    key_file.write_bytes(b"a codec-test record secret, 32 bytes!\n")
    key_file.chmod(0o600)
    tier = open_tier(tmp_path / "disk", serde="fp8", record_key_file=str(key_file))
    keys = make_keys(2 * 64, chunk_size=64, layout=BF16)
    want = _store(tier, keys)
    got = _load(tier, keys)
    assert len(got) == 2 and all(float(rel_l2(a, b).max()) < 0.06
                                 for a, b in zip(want, got, strict=True))
    path = tier.path_for(keys[0].key)
    assert path.stat().st_size < 0.55 * BF16.nbytes(64)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a bit of the ciphertext (the scales' end)
    path.write_bytes(bytes(data))
    corrupt = tier.stats()["corrupt"]
    assert _load(tier, keys) == []  # the checksum over the stored bytes fails: a miss
    assert tier.stats()["corrupt"] == corrupt + 1 and not path.exists()  # deleted


def test_a_plain_fp8_record_is_decoded_piece_by_piece_and_a_flipped_byte_is_a_miss(
        open_tier: Open, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain coded record is read a few blocks at a time, each decoded into the arena object
    before the checksum of the whole is known: what loads is bit for bit torch's decode of the
    file's payload, and a byte flipped in the values or in the scales (read first) is a counted
    corrupt miss that leaves nothing allocated (the fixture checks the arena)."""
    # Pieces need the compiled kernel, which a load never builds: build it here, as a server
    # does at start, so the test does not depend on an earlier test of this process doing so.
    monkeypatch.delenv("KVTIER_KERNEL", raising=False)
    ops.prepare()
    monkeypatch.setattr(record_files, "CODED_PIECE", 100_000)  # two blocks: 4 pieces of 8
    calls: list[int] = []
    decode_blocks = ScaledCodec.decode_blocks

    def counted(self: ScaledCodec, values: memoryview, *args: object) -> None:
        calls.append(len(values))
        decode_blocks(self, values, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ScaledCodec, "decode_blocks", counted)
    tier = open_tier(tmp_path / "disk", serde="fp8")
    keys = make_keys(TOKENS, chunk_size=TOKENS, layout=BF16)
    for flip in (None, 1000, -1):  # nothing; a value of layer 0's K; the last V scale's top
        _store(tier, keys)
        path = tier.path_for(keys[0].key)
        payload = bytearray(path.read_bytes()[expected_header_len(keys[0]):])
        if flip is None:
            want = torch.empty(BF16.shape(TOKENS), dtype=BF16.dtype)
            assert isinstance(FP8, ScaledCodec)
            FP8.decode_torch(memoryview(payload), want)
            got = _load(tier, keys)
            assert len(got) == 1 and same_bytes(got[0], want)
            assert calls == [2 * TOKENS * 192] * 4
            continue
        data = bytearray(path.read_bytes())
        data[flip] ^= 0x40
        path.write_bytes(bytes(data))
        corrupt = tier.stats()["corrupt"]
        assert _load(tier, keys) == []
        assert tier.stats()["corrupt"] == corrupt + 1 and not path.exists()
