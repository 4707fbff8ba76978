"""The Redis tier against real redis-server processes (fixtures in tests/conftest.py):
configuration and the data path (topologies and faults: test_redis_faults.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.redis import RedisProcess
from kvtier.backends.redis import RedisBackend
from kvtier.backends.redis.io import ReplyReader, redis_keys
from kvtier.errors import ConfigError
from kvtier.memory import lease
from tests.backends.conftest import redis_backend
from tests.backends.redis.redis_helpers import MID, SEGMENT_MB, _check, _put
from tests.helpers import make_keys, run_threads, same_bytes

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
    root = Path(__file__).resolve().parents[3]

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
