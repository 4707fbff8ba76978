"""The Redis tier against real redis-server processes (fixtures in tests/conftest.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier.backends.redis import RedisBackend
from kvtier.backends.redis.io import ReplyReader, redis_keys
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryObj, lease
from tests.backends.conftest import redis_backend
from tests.conftest import RedisCluster, RedisProcess, RedisSentinel
from tests.helpers import SMALL_MHA, make_keys, make_obj, put_random, run_threads, same_bytes

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


# ---- configuration -----------------------------------------------------------------------

@pytest.mark.parametrize("url, problem", [
    ("http://h:1", "scheme"),
    ("redis://user:hunter2@h:notaport", "Port"),
    ("redis://user:hunter2@h:1/notadb", "database"),
    ("redis://:hunter2@h:1?socket_timeout=3", "query parameter"),
    ("redis-sentinel://:hunter2@h:26379", "service name"),
    ("redis-cluster://:hunter2@h:1,:2", "empty host"),
    ("redis-cluster://:hunter2@h:1/4", "database 0"),
    ("unix://", "socket path"),
])
def test_bad_url_is_a_config_error_naming_the_redacted_url(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as info:
        redis_backend(url)
    assert "remote_url" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_password_and_acl_user_work_and_wrong_password_fails_at_start(
    redis_auth_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    port = redis_auth_server.port
    keys = make_keys(32, layout=MID)
    expected = _put(make_backend(redis_auth_server.url, layout=MID,
                                 remote_segment_mb=SEGMENT_MB), keys)
    acl = make_backend(f"redis://kvuser:kvpass@127.0.0.1:{port}", layout=MID,
                       remote_segment_mb=SEGMENT_MB)
    _check(acl, keys, expected)
    for url in (f"redis://:wrong-pw@127.0.0.1:{port}", f"redis://kvuser:nope-pw@127.0.0.1:{port}",
                f"redis://127.0.0.1:{port}"):
        with pytest.raises(ConfigError, match="authentication failed") as info:
            redis_backend(url)
        assert "wrong-pw" not in str(info.value) and "nope-pw" not in str(info.value)


def test_tls_round_trip(redis_tls_server: RedisProcess,
                       make_backend: Callable[..., RedisBackend]) -> None:
    backend = make_backend(redis_tls_server.url, layout=MID, remote_segment_mb=SEGMENT_MB)
    keys = make_keys(48, layout=MID)
    _check(backend, keys, _put(backend, keys))
    assert backend.stats()["down"] == 0


def test_unix_socket_round_trip(redis_server: RedisProcess,
                                make_backend: Callable[..., RedisBackend]) -> None:
    backend = make_backend(f"unix://{redis_server.unix_path}")
    keys = make_keys(32, seed=11)
    _check(backend, keys, _put(backend, keys))


# ---- data path ---------------------------------------------------------------------------

def test_segmented_records_round_trip_with_ttl_on_every_key(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    backend = make_backend(redis_server.url, layout=MID, remote_segment_mb=SEGMENT_MB,
                           remote_ttl_secs=600)
    keys = make_keys(64, layout=MID, seed=21)
    expected = _put(backend, keys)
    _check(backend, keys, expected)
    client = redis_server.client()
    names = [n for k in keys for n in redis_keys(k, 2) if client.exists(n)]
    assert len(names) == 2 * len(keys)  # main key + one more segment each
    assert all(0 < client.ttl(n) <= 600 for n in names)
    assert backend.remove(keys) == len(keys)
    assert backend.batch_contains(keys) == 0
    whole = make_backend(redis_server.url, remote_ttl_secs=300)  # one SET ... EX per chunk
    small = make_keys(16, seed=22)
    _put(whole, small)
    main = redis_keys(small[0], 1)[0]
    assert 0 < client.ttl(main) <= 300


def test_a_large_batch_of_small_records_is_pipelined_byte_exact(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    # ~300 KiB of replies: reply lines straddle the reader's buffer boundaries many times.
    backend = make_backend(redis_server.url)
    keys = make_keys(16 * 128, seed=12)
    _check(backend, keys, _put(backend, keys))
    assert backend.remove(keys[100:]) == 28
    assert backend.batch_contains(keys) == 100


def test_reply_reader_parses_replies_straddling_its_buffer() -> None:
    # Lines of 5 bytes never end exactly at the buffer's end, so partial lines get moved.
    stream = b":12\r\n" * 30_000 + b"$5\r\nhello\r\n*2\r\n$-1\r\n+OK\r\n"
    left, right = socket.socketpair()
    sender = threading.Thread(target=left.sendall, args=(stream,))
    sender.start()
    try:
        reader = ReplyReader(right)
        assert all(reader.reply() == 12 for _ in range(30_000))
        assert reader.reply() == b"hello"
        assert reader.reply() == [None, b"OK"]
        assert reader.pending == 0
    finally:
        sender.join()
        left.close()
        right.close()


def test_a_huge_announced_reply_is_a_protocol_error_not_an_allocation() -> None:
    # A hostile server answering EXISTS with a 1.5 GB bulk string (it took 1.5 GB of RSS).
    import tracemalloc

    from redis.exceptions import ConnectionError as RedisConnectionError

    left, right = socket.socketpair()
    left.sendall(b"$1500000000\r\n" + b"x" * 1000)
    left.close()  # an unbounded reader would allocate 1.5 GB, then hit the end of the stream
    tracemalloc.start()
    try:
        with pytest.raises(RedisConnectionError, match="1500000000-byte bulk reply"):
            ReplyReader(right).reply()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        right.close()
    assert peak < 1_000_000


def test_concurrent_puts_and_gets_are_byte_exact(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    backend = make_backend(redis_server.url, layout=MID, remote_segment_mb=SEGMENT_MB,
                           arena_mb=128)

    def worker(seed: int) -> None:
        keys = make_keys(64, layout=MID, seed=100 + seed)
        for _ in range(3):
            _check(backend, keys, _put(backend, keys, seed=seed))

    run_threads(worker, [(i,) for i in range(4)])


def test_reads_racing_rewrites_never_mix_segments(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Reads fetch a chunk's segments one GET at a time; a rewrite between two GETs must be
    # caught by the checksum (and re-read atomically), never served as a mix of two versions.
    import kvtier.backends.redis.backend as kr

    monkeypatch.setattr(kr, "_WINDOW", {True: 1, False: 64 << 20})  # widen the race window
    backend = make_backend(redis_server.url, layout=MID, remote_segment_mb=SEGMENT_MB / 2,
                           arena_mb=128)
    keys = make_keys(64, layout=MID, seed=77)
    versions = [_put(backend, keys, seed=1), _put(backend, keys, seed=2)]
    stop = threading.Event()

    def rewrite() -> None:
        i = 0
        while not stop.is_set():
            _put(backend, keys, seed=1 + i % 2)
            i += 1

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        deadline = time.monotonic() + 3.0  # a bounded loop, not a timing assertion
        while time.monotonic() < deadline:
            with lease(backend.batch_get(keys)) as got:
                for i, obj in enumerate(got):
                    assert any(same_bytes(obj.tensor, v[i]) for v in versions)
    finally:
        stop.set()
        writer.join()
    assert backend.stats()["corrupt"] == 0


def test_arena_full_returns_the_prefix_without_leaking(
    redis_server: RedisProcess, make_backend: Callable[..., RedisBackend],
) -> None:
    writer = make_backend(redis_server.url, layout=MID, remote_segment_mb=SEGMENT_MB)
    keys = make_keys(16 * 6, layout=MID, seed=31)
    _put(writer, keys)
    small = make_backend(redis_server.url, layout=MID, remote_segment_mb=SEGMENT_MB,
                         arena_mb=2)  # room for 3 of the 6 chunks
    with lease(small.batch_get(keys)) as got:
        assert 0 < len(got) < len(keys)
    assert small.stats()["alloc_failures"] == 1


def _share_script(role: str, url: str, model: str) -> str:
    return f"""
import hashlib, sys
from kvtier.backends import BackendContext
from kvtier.backends.redis import RedisBackend
from kvtier.config import Config
from kvtier.memory import MemoryAllocator, lease
from tests.helpers import SMALL_MHA, make_keys, make_obj, put_random
cfg = Config(chunk_size=16, max_local_cpu_size=0.064, remote_url={url!r})
alloc = MemoryAllocator(int(cfg.max_local_cpu_size * 1e9))
backend = RedisBackend(BackendContext(cfg, SMALL_MHA, alloc))
keys = make_keys(80, model={model!r}, seed=5)
if {role!r} == "put":
    objs = [make_obj(alloc, SMALL_MHA, k.num_tokens, 40 + i) for i, k in enumerate(keys)]
    with lease(objs):
        assert backend.batch_put(keys, objs) == len(keys)
else:
    objs = backend.batch_get(keys)
digest = hashlib.sha256(b"".join(bytes(o.byte_view()) for o in objs)).hexdigest()
print(len(objs), digest)
for o in ([] if {role!r} == "put" else objs):
    o.release()
backend.close()
"""


def test_two_processes_share_and_another_model_misses(redis_server: RedisProcess) -> None:
    redis_server.client().flushall()
    root = Path(__file__).resolve().parents[2]

    def start(role: str, model: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", _share_script(role, redis_server.url,
                                                                     model)],
                                cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def result(proc: subprocess.Popen[str]) -> list[str]:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        return out.split()

    stored = result(start("put", "model-a"))
    assert stored[0] == "5"
    same, other = start("get", "model-a"), start("get", "model-b")  # two more processes
    assert result(same) == stored  # byte-exact in another process
    assert result(other)[0] == "0"


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
