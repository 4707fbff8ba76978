"""A record of another kvtier's format (a newer version, or flag bits this one does not know)
on the real tiers: a counted `other_version` miss, left in place, never deleted (issue 51,
item 11: the next format bump would have wiped the cache older and newer servers share)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.redis import RedisProcess
from kvtier.backends.base import BackendContext, StorageBackend
from kvtier.backends.disk import DiskBackend
from kvtier.backends.record import VERSION
from kvtier.backends.redis import RedisBackend
from kvtier.config import Config
from kvtier.keys import redis_names
from kvtier.memory import MemoryAllocator, lease
from tests.helpers import SMALL_MHA, make_keys, put_random, same_bytes

VERSION_AT = 4  # after the 4-byte magic: a little-endian u16


def _tier(kind: str, tmp_path: Path, redis: RedisProcess) -> StorageBackend:
    cfg = Config(chunk_size=16, **({"remote_url": redis.url} if kind == "redis" else
                                   {"local_disk": str(tmp_path / "d"),
                                    "max_local_disk_size": 0.1}))
    ctx = BackendContext(cfg, SMALL_MHA, MemoryAllocator(1 << 22))
    return RedisBackend(ctx) if kind == "redis" else DiskBackend(ctx)


def _rewriter(kind: str, tier: StorageBackend, redis: RedisProcess,
              ) -> Callable[[str, Callable[[bytes], bytes]], bytes]:
    """`rewrite(key, change)`: the stored record of `key` replaced by `change(record)`;
    returns the new stored bytes."""
    def rewrite(key: str, change: Callable[[bytes], bytes]) -> bytes:
        if kind == "disk":
            assert isinstance(tier, DiskBackend)
            path = tier.path_for(key)
            path.write_bytes(change(path.read_bytes()))
            return path.read_bytes()
        client = redis.client()
        name = redis_names(key)[0]
        client.set(name, change(client.get(name)))
        return client.get(name)
    return rewrite


def _stored(kind: str, tier: StorageBackend, redis: RedisProcess, key: str) -> bytes:
    if kind == "disk":
        assert isinstance(tier, DiskBackend)
        return tier.path_for(key).read_bytes()
    return redis.client().get(redis_names(key)[0])


@pytest.mark.parametrize("kind", ["redis", "disk"])
@pytest.mark.parametrize("change", ["newer_version", "unknown_flags"])
def test_a_record_of_another_format_is_a_counted_miss_left_in_place(
        kind: str, change: str, tmp_path: Path, redis_server: RedisProcess) -> None:
    tier = _tier(kind, tmp_path, redis_server)
    keys = make_keys(3 * 16, seed=11)
    try:
        want = put_random(tier.batch_put, tier.ctx.allocator, SMALL_MHA, keys, seed=3)

        rewrite = _rewriter(kind, tier, redis_server)
        kept = rewrite(keys[1].key, _newer if change == "newer_version" else _with_unknown_flag)
        with lease(tier.batch_get(keys)) as got:  # the prefix stops at the foreign record
            assert len(got) == 1 and same_bytes(got[0].tensor, want[0])
        stats = tier.stats()
        assert stats["other_version"] == 1 and stats["corrupt"] == 0
        assert _stored(kind, tier, redis_server, keys[1].key) == kept  # left in place
        with lease(tier.batch_get(keys[2:])) as got:  # neighbours untouched
            assert len(got) == 1 and same_bytes(got[0].tensor, want[2])
    finally:
        tier.close()


def _newer(record: bytes) -> bytes:
    return record[:VERSION_AT] + struct.pack("<H", VERSION + 1) + record[VERSION_AT + 2:]


def _with_unknown_flag(record: bytes) -> bytes:
    """`record` with a flag bit no kvtier version defines, its header checksum recomputed (a
    newer writer's valid header, not damage)."""
    import xxhash

    from kvtier.backends import record as rec

    fields = list(rec._FIXED.unpack_from(record))  # noqa: SLF001 - the fixed header's layout
    fields[13] |= 0x80  # flags
    hlen = fields[2]
    head = bytearray(record[:hlen])
    rec._FIXED.pack_into(head, 0, *fields)  # noqa: SLF001
    checked = rec._CHECKED  # noqa: SLF001
    fields[15] = xxhash.xxh3_64_intdigest(bytes(head[:checked]) + bytes(head[rec.FIXED_SIZE:]))
    rec._FIXED.pack_into(head, 0, *fields)  # noqa: SLF001
    return bytes(head) + record[hlen:]
