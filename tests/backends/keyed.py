"""What the tests of encrypted records on the real tiers share: key files, tiers of one kind over
one store (a Redis, a disk directory) each with its own keys, and a record's raw stored bytes
as a reader of that store sees them."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from harness.redis import RedisProcess
from kvtier.backends.base import BackendContext, StorageBackend
from kvtier.backends.disk import DiskBackend
from kvtier.backends.disk.files import file_name, record_path
from kvtier.backends.record import FIXED_SIZE, header_len
from kvtier.backends.redis import RedisBackend
from kvtier.config import Config
from kvtier.keys import ChunkKey, redis_names
from kvtier.memory import KVLayout, MemoryAllocator, lease
from tests.helpers import SMALL_MHA, put_random, same_bytes

NEW = b"this month's secret, 32 bytes..."
OLD = b"last month's secret, 32 bytes..."
OTHER = b"another fleet's secret, 32 bytes"

Tiers = Callable[..., StorageBackend]
_SUM_AT = FIXED_SIZE - 16  # the payload checksum, then the header checksum


def key_file(tmp_path: Path, *secrets: bytes) -> str:
    """A record key file (0600) holding `secrets`, one per line, the current first."""
    path = tmp_path / f"key-{len(list(tmp_path.glob('key-*')))}"
    path.write_bytes(b"\n".join(secrets) + b"\n")
    path.chmod(0o600)
    return str(path)


def tier_factory(kind: str, tmp_path: Path, redis: RedisProcess, opened: list[StorageBackend],
                 ) -> Tiers:
    """`make(*secrets, layout=SMALL_MHA, atomic_reads=False, **config)`: a tier of `kind`
    over the test's one store, holding record keys `secrets` (none: a keyless tier), appended
    to `opened`; `atomic_reads` as `RedisBackend`'s."""
    def make(*secrets: bytes, layout: KVLayout = SMALL_MHA, atomic_reads: bool = False,
             **cfg: object) -> StorageBackend:
        where: dict[str, object] = ({"remote_url": redis.url} if kind == "redis" else
                                    {"local_disk": str(tmp_path / "d"), "max_local_disk_size": 0.1})
        config = Config(chunk_size=16, hash_salt="encryption-test",  # type: ignore[arg-type]
                        record_key_file=key_file(tmp_path, *secrets) if secrets else None,
                        **where, **cfg)
        ctx = BackendContext(config, layout, MemoryAllocator(16 << 20))
        tier: StorageBackend = (RedisBackend(ctx, atomic_reads=atomic_reads) if kind == "redis"
                                else DiskBackend(ctx))
        opened.append(tier)
        return tier
    return make


class Store:
    """The store of a test's tiers as anyone who can read or write it sees it: the raw bytes of
    a record (the file, or the Redis values, header and segments, joined)."""

    def __init__(self, kind: str, tmp_path: Path, redis: RedisProcess):
        self.kind, self.root = kind, tmp_path / "d"
        self.client = redis.client() if kind == "redis" else None

    def read(self, key: ChunkKey) -> bytes:
        """The stored bytes of `key`'s record; b"" when there is none."""
        if self.client is None:
            path = record_path(self.root, file_name(key.key))
            return path.read_bytes() if path.exists() else b""
        values = self.client.mget(redis_names(key.key, 64))  # up to 64 segments
        return b"".join(v for v in values if v is not None)

    def write(self, key: ChunkKey, data: bytes) -> None:
        """Replace the stored bytes of `key`'s one-piece record (a neighbour's write)."""
        if self.client is None:
            record_path(self.root, file_name(key.key)).write_bytes(data)
        else:
            self.client.set(redis_names(key.key)[0], data)


def close_all(opened: list[StorageBackend]) -> None:
    """Close the tiers a test opened, and check that each gave its arena memory back."""
    for tier in opened:
        tier.close()
        alloc = tier.ctx.allocator  # type: ignore[attr-defined]
        alloc.check_integrity()
        assert alloc.used_bytes == 0, f"the {tier.name} tier leaked arena memory"


def refresh_checksums(buf: bytearray) -> bytearray:
    """Recompute a record's payload and header checksums in place, as a neighbour who can
    write the store would after changing it; returns `buf`."""
    hlen = header_len(buf)
    buf[_SUM_AT : _SUM_AT + 8] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[hlen:])))
    hsum = xxhash.xxh3_64_intdigest(bytes(buf[: FIXED_SIZE - 8]) + bytes(buf[FIXED_SIZE:hlen]))
    buf[FIXED_SIZE - 8 : FIXED_SIZE] = struct.pack("<Q", hsum)
    return buf


def put_random_records(tier: StorageBackend, keys: list[ChunkKey],
                       seed: int = 0) -> list[torch.Tensor]:
    """Stores random payloads under `keys` in `tier`; returns them."""
    ctx = tier.ctx  # type: ignore[attr-defined]
    return put_random(tier.batch_put, ctx.allocator, ctx.layout, keys, seed)


def loads(tier: StorageBackend, keys: list[ChunkKey], want: list[torch.Tensor]) -> bool:
    """Whether `tier` loads every one of `keys`, byte-exact against `want` (False: no hit)."""
    with lease(tier.batch_get(keys)) as got:
        if not got:
            return False
        assert len(got) == len(keys)
        assert all(same_bytes(o.tensor, w) for o, w in zip(got, want))
        return True
