"""The Redis tier against real redis-server processes (fixtures in tests/conftest.py): a
cluster and a sentinel, then faults (a killed server, one down at start, foreign records)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from harness.redis import RedisCluster, RedisProcess, RedisSentinel
from kvtier.backends.redis import RedisBackend
from kvtier.backends.redis.io import redis_keys
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj
from tests.backends.redis.redis_helpers import (
    MID,
    RECOVERY_DEADLINE,
    SEGMENT_MB,
    _check,
    _hits,
    _put,
)
from tests.helpers import SMALL_MHA, make_keys, make_obj

# ---- topologies --------------------------------------------------------------------------

def test_cluster_spreads_chunks_over_all_masters_and_batches_across_slots(
    redis_cluster: RedisCluster, make_backend: Callable[..., RedisBackend],
) -> None:
    backend = make_backend(redis_cluster.url, layout=MID, remote_segment_mb=SEGMENT_MB)
    keys = make_keys(16 * 24, layout=MID, seed=41)
    expected = _put(backend, keys)
    assert all(node.client().dbsize() > 0 for node in redis_cluster.nodes)
    _check(backend, keys, expected)
    assert backend.remove(keys[5:6]) == 1
    assert backend.batch_contains(keys) == 5
    assert _hits(backend, keys) == 5
    assert backend.stats()["errors"] == 0


def test_sentinel_finds_the_master(redis_sentinel: RedisSentinel,
                                   make_backend: Callable[..., RedisBackend]) -> None:
    backend = make_backend(redis_sentinel.url)
    keys = make_keys(48, seed=51)
    expected = _put(backend, keys)
    _check(backend, keys, expected)
    assert redis_sentinel.master.client().dbsize() >= len(keys)


# ---- faults ------------------------------------------------------------------------------

def _wait_for_hits(backend: RedisBackend, keys: list[ChunkKey], objs: list[MemoryObj]) -> bool:
    deadline = time.monotonic() + RECOVERY_DEADLINE
    while time.monotonic() < deadline:
        backend.batch_put(keys, objs)
        if _hits(backend, keys) == len(keys):
            return True
        time.sleep(0.02)
    return False


def test_sigkill_during_a_loop_degrades_and_hits_resume_after_restart(
    redis_factory: Callable[..., RedisProcess], make_backend: Callable[..., RedisBackend],
) -> None:
    server = redis_factory()
    backend = make_backend(server.url, layout=MID, remote_segment_mb=SEGMENT_MB)
    ctx = backend.ctx
    keys = make_keys(16 * 4, layout=MID, seed=61)
    objs = [make_obj(ctx.allocator, MID, 16, i) for i in range(len(keys))]
    halfway = threading.Event()
    killer = threading.Thread(target=lambda: (halfway.wait(), server.kill()))
    killer.start()
    try:
        misses = 0
        for i in range(300):  # must finish: no exception, no hang
            if i == 20:
                halfway.set()
            backend.batch_put(keys, objs)
            misses += _hits(backend, keys) < len(keys)
        killer.join()
        assert misses > 0 and backend.stats()["down_events"] >= 1
        server.start()
        assert _wait_for_hits(backend, keys, objs), "no hits within 5 s of the restart"
    finally:
        halfway.set()
        killer.join()
        for obj in objs:
            obj.release()
        server.stop()


def test_unreachable_at_start_starts_down_then_comes_up(
    redis_factory: Callable[..., RedisProcess], make_backend: Callable[..., RedisBackend],
) -> None:
    server = redis_factory()
    server.stop()  # its port is now closed; the tier must start anyway
    backend = make_backend(server.url)
    keys = make_keys(16)
    assert backend.stats()["down"] == 1
    assert backend.batch_contains(keys) == 0
    obj = make_obj(backend.ctx.allocator, SMALL_MHA, 16, 0)
    try:
        assert backend.batch_put(keys, [obj]) == 0
        assert backend.stats()["skipped_down"] >= 2
        server.start()
        assert _wait_for_hits(backend, keys, [obj]), "no hits within 5 s of the server start"
    finally:
        obj.release()
        server.stop()


def test_garbage_and_foreign_records_are_misses_deleted_and_counted(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    backend = make_backend(redis_server.url, layout=MID, remote_segment_mb=SEGMENT_MB)
    keys = make_keys(48, layout=MID, seed=71)
    _put(backend, keys)
    client = redis_server.client()
    main = [redis_keys(k, 1)[0] for k in keys]
    assert client.exists(*main) == 3
    client.set(main[0], b"garbage")
    client.set(main[1], client.get(main[2]))  # another chunk's (valid) record
    client.delete(main[2] + "#1")  # a lost segment
    for i, k in enumerate(keys):
        assert backend.batch_get([k]) == []
        assert client.exists(main[i]) == 0, "a corrupt record was not deleted"
    assert backend.stats()["corrupt"] == 3


def test_a_value_of_another_type_is_a_miss_and_deleted(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    backend = make_backend(redis_server.url)
    keys = make_keys(16, seed=72)
    _put(backend, keys)
    main = redis_keys(keys[0], 1)[0]
    client = redis_server.client()
    client.delete(main)
    client.rpush(main, b"not a string")
    assert backend.batch_get(keys) == []
    assert client.exists(main) == 0
    assert backend.stats()["corrupt"] == 1


def test_other_segment_size_is_a_counted_miss_not_a_deletion(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    writer = make_backend(redis_server.url, layout=MID, remote_segment_mb=SEGMENT_MB)
    reader = make_backend(redis_server.url, layout=MID, remote_segment_mb=4.0)
    keys = make_keys(16, layout=MID, seed=81)
    expected = _put(writer, keys)
    assert reader.batch_get(keys) == []
    assert reader.stats()["segment_mismatches"] == 1
    _check(writer, keys, expected)
