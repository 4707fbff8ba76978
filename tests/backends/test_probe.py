"""`StorageBackend.probe`: every tier is timed whatever it holds, with a scratch record that
no listing, lookup or count sees and that is gone afterwards, also after a failure half-way."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from harness.redis import RedisCluster, RedisProcess, RedisSentinel
from kvtier.backends import BackendContext, StorageBackend
from kvtier.backends.base import PROBE_PREFIX
from kvtier.backends.disk import DiskBackend
from kvtier.backends.disk.inflight import GRACE_S
from kvtier.backends.disk.probe import scratch_files
from kvtier.backends.redis import RedisBackend
from kvtier.backends.redis import probe as redis_probe
from kvtier.config.names import CPU
from tests.helpers import make_keys

NBYTES = 300_000  # more than one read buffer, not a multiple of any


def _leftovers(backend: StorageBackend) -> int:
    """Scratch records (or anything else) a probe left in the tier."""
    if isinstance(backend, DiskBackend):
        return len(scratch_files(backend.root)) + len(list(backend.root.rglob("*.kvt")))
    assert isinstance(backend, RedisBackend)
    url = backend.ctx.config.remote_url or ""
    port = int(url.rsplit(":", 1)[1])
    import redis

    return int(redis.Redis(port=port).dbsize())


def test_every_tier_is_timed_with_a_scratch_record_it_does_not_keep(
        backend_ctx: tuple[StorageBackend, BackendContext]) -> None:
    backend, _ = backend_ctx
    samples = backend.probe(NBYTES)
    if backend.name == CPU:
        assert samples == []  # memory: nothing to time
        return
    (sample,) = samples  # the tier holds nothing, and is timed all the same
    assert sample.read_bytes == NBYTES
    assert 0 < sample.round_trip_s and 0 < sample.read_s
    assert _leftovers(backend) == 0
    assert backend.batch_contains(make_keys(32)) == 0
    assert backend.stats()["puts"] == 0 and backend.stats()["hits"] == 0


def test_a_cluster_is_timed_on_each_primary(
        make_backend: Callable[..., RedisBackend], redis_cluster: RedisCluster) -> None:
    backend = make_backend(redis_cluster.url)
    samples = backend.probe(NBYTES)
    assert len(samples) == len(redis_cluster.masters()) == 3
    assert all(s.read_bytes == NBYTES for s in samples)
    # the cluster is shared with other tests (it may hold their records): no scratch is left
    assert not any(node.client().keys(f"*{PROBE_PREFIX}*") for node in redis_cluster.nodes)


def test_a_sentinel_tier_is_timed_on_the_master_it_finds(
        make_backend: Callable[..., RedisBackend], redis_sentinel: RedisSentinel) -> None:
    before = int(redis_sentinel.master.client().dbsize())  # the session's other tests' keys
    backend = make_backend(redis_sentinel.url)
    (sample,) = backend.probe(NBYTES)
    assert sample.read_bytes == NBYTES
    assert int(redis_sentinel.master.client().dbsize()) == before


def test_a_redis_probe_failing_half_way_deletes_its_value(
        make_backend: Callable[..., RedisBackend], redis_server: RedisProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    redis_server.client().flushall()
    backend = make_backend(redis_server.url)
    written: list[int] = []

    def broken_read(client: object, name: str, nbytes: int) -> int:
        written.append(int(redis_server.client().exists(name)))  # the SET went through
        raise RedisConnectionError("connection reset by the test")

    monkeypatch.setattr(redis_probe, "_read", broken_read)
    assert backend.probe(NBYTES) == []  # a failure: no sample, the tier's failure rule
    assert written == [1]
    assert int(redis_server.client().dbsize()) == 0  # and deleted all the same


def test_a_redis_probe_value_expires_if_its_delete_never_arrives(
        make_backend: Callable[..., RedisBackend], redis_server: RedisProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    redis_server.client().flushall()
    backend = make_backend(redis_server.url)
    ttls: list[int] = []

    def broken_read(client: object, name: str, nbytes: int) -> int:
        ttls.append(int(redis_server.client().ttl(name)))
        raise RedisConnectionError("connection reset by the test")

    real_one = redis_probe._one

    def no_delete(client: object, *command: object, sent: int = 0) -> object:
        if command[0] == "DEL":
            raise RedisConnectionError("the network went away")
        return real_one(client, *command, sent=sent)  # type: ignore[arg-type]

    monkeypatch.setattr(redis_probe, "_read", broken_read)
    monkeypatch.setattr(redis_probe, "_one", no_delete)
    assert backend.probe(NBYTES) == []
    assert ttls and 0 < ttls[0] <= redis_probe.PROBE_TTL_S
    redis_server.client().flushall()


def test_a_disk_probe_file_left_by_a_killed_process_is_removed(
        open_disk: Callable[..., DiskBackend]) -> None:
    disk = open_disk()
    orphan = disk.root / ".kvtier-probe.999999999.0.tmp"  # unlocked: its writer is gone
    orphan.write_bytes(b"x" * 100)
    old = time.time() - 2 * GRACE_S  # past the grace a file has before its writer locks it
    os.utime(orphan, (old, old))
    assert disk.probe(4096)[0].read_bytes == 4096
    assert scratch_files(disk.root) == []
