"""Records under a record key on the real tiers: with a record key, a record a neighbour wrote
(right key, right checksums, its own payload, in clear) is a counted `forged` miss, never
loaded; a reader without the key loads no encrypted record; and no reader deletes a record over
its key (a node with a stale or mistyped key must not erase the shared cache as it reads it).
Secrecy, rotation and tampering: test_record_keys.py, test_record_secrecy.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from harness.redis import RedisProcess
from kvtier.backends.base import BackendContext, StorageBackend
from kvtier.backends.disk import DiskBackend
from kvtier.backends.redis import RedisBackend
from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.memory import MemoryAllocator, lease
from tests.helpers import SMALL_MHA, make_keys, put_random, same_bytes

SECRET = b"0123456789abcdefghijklmnopqrstuv"  # no repeat: a repeated phrase is guessable


def _key_file(tmp_path: Path, secret: bytes, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(secret)
    path.chmod(0o600)
    return str(path)


def _tiers(kind: str, tmp_path: Path, redis: RedisProcess,
           ) -> Callable[[str | None], StorageBackend]:
    """Backends of one kind over one store (a Redis, a disk directory), each with its own
    record key file (or none)."""
    def make(key_file: str | None) -> StorageBackend:
        cfg = Config(chunk_size=16, record_key_file=key_file, hash_salt="auth-test",
                     **({"remote_url": redis.url} if kind == "redis"
                        else {"local_disk": str(tmp_path / "d"), "max_local_disk_size": 0.1}))
        ctx = BackendContext(cfg, SMALL_MHA, MemoryAllocator(1 << 22))
        return RedisBackend(ctx) if kind == "redis" else DiskBackend(ctx)
    return make


@pytest.mark.parametrize("kind", ["redis", "disk"])
def test_records_without_the_key_are_never_loaded(kind: str, tmp_path: Path,
                                                  redis_server: RedisProcess) -> None:
    make = _tiers(kind, tmp_path, redis_server)
    owner = make(_key_file(tmp_path, SECRET, "k1"))
    neighbour = make(None)  # can write the store, does not hold the key
    stranger = make(_key_file(tmp_path, b"another secret of 32 bytes......", "k2"))
    keys = make_keys(4 * 16, seed=7 if kind == "redis" else 8)
    try:
        genuine = put_random(owner.batch_put, owner.ctx.allocator, SMALL_MHA, keys, seed=1)
        with lease(owner.batch_get(keys)) as got:
            assert [same_bytes(o.tensor, w) for o, w in zip(got, genuine)] == [True] * 4
        assert neighbour.batch_get(keys) == []  # no key: never loads what it cannot verify
        assert stranger.batch_get(keys) == []  # another key: not ours
        assert neighbour.stats()["forged"] >= 1 and stranger.stats()["forged"] >= 1
        with lease(owner.batch_get(keys)) as got:  # and neither of them deleted anything
            assert [same_bytes(o.tensor, w) for o, w in zip(got, genuine)] == [True] * 4
        fake = put_random(neighbour.batch_put, neighbour.ctx.allocator, SMALL_MHA, keys, seed=2)
        assert owner.batch_get(keys) == []  # the neighbour's records: forged, a miss
        stats = owner.stats()
        assert stats["forged"] >= 1 and stats["corrupt"] == 0
        with lease(neighbour.batch_get(keys)) as got:  # left in place by the owner's read
            assert [same_bytes(o.tensor, w) for o, w in zip(got, fake)] == [True] * 4
    finally:
        for tier in (owner, neighbour, stranger):
            tier.close()


def test_a_missing_or_short_record_key_stops_the_tier_naming_the_key(
        tmp_path: Path, redis_server: RedisProcess) -> None:
    make = _tiers("redis", tmp_path, redis_server)
    with pytest.raises(ConfigError, match="record_key_file"):
        make(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="record_key_file.*at least"):
        make(_key_file(tmp_path, b"short", "k3"))
