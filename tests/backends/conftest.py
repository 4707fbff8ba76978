"""The `backend` fixture: every storage tier behind one conformance suite; the disk tier's
`arena` and `open_disk`; the Redis tier's `make_backend`.

To add a tier, add its name to BACKEND_NAMES and a branch to `_config_for`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.backends import BackendContext, StorageBackend, create_backend
from kvtier.backends.disk import DiskBackend
from kvtier.backends.redis import RedisBackend
from kvtier.config import Config
from kvtier.memory import KVLayout, MemoryAllocator
from tests.backends.disk.disk_helpers import CHUNK, Opener
from tests.helpers import SMALL_MHA

# "+key": the tier with a record key (records encrypted, see kvtier/backends/sealing.py).
BACKEND_NAMES = ["cpu", "disk", "redis", "disk+key", "redis+key"]


def _config_for(name: str, request: pytest.FixtureRequest) -> Config:
    if name.endswith("+key"):
        tmp = request.getfixturevalue("tmp_path")
        key_file = tmp / "record.key"
        key_file.write_bytes(b"a conformance-suite secret, 32 bytes\n")
        key_file.chmod(0o600)
        return replace(_config_for(name.removesuffix("+key"), request),
                       record_key_file=str(key_file))
    if name == "cpu":
        return Config(chunk_size=16, max_local_cpu_size=0.064)
    if name == "disk":
        tmp = request.getfixturevalue("tmp_path")
        return Config(chunk_size=16, max_local_cpu_size=0.064, local_disk=str(tmp / "disk"),
                      max_local_disk_size=0.01)
    if name == "redis":
        server = request.getfixturevalue("redis_server")
        server.client().flushall()  # the server is shared by the session: start each test empty
        return Config(chunk_size=16, max_local_cpu_size=0.064, remote_url=server.url)
    raise AssertionError(f"no conformance config for backend {name!r}")


@pytest.fixture(params=BACKEND_NAMES)
def backend_ctx(request: pytest.FixtureRequest) -> Iterator[tuple[StorageBackend, BackendContext]]:
    config = _config_for(request.param, request)
    alloc = MemoryAllocator(int(config.max_local_cpu_size * 1e9))
    ctx = BackendContext(config=config, layout=SMALL_MHA, allocator=alloc)
    backend = create_backend(request.param.removesuffix("+key"), ctx)
    try:
        yield backend, ctx
    finally:
        backend.close()
    alloc.check_integrity()
    assert alloc.used_bytes == 0, "a backend leaked arena memory"


@pytest.fixture
def arena() -> Iterator[MemoryAllocator]:
    """The engine's arena, shared by every tier a test opens."""
    alloc = MemoryAllocator(16 << 20)
    yield alloc
    assert alloc.used_bytes == 0, "the disk tier leaked arena memory"
    alloc.check_integrity()


@pytest.fixture
def open_disk(tmp_path: Path, arena: MemoryAllocator) -> Iterator[Opener]:
    """Opens disk tiers (default: on `tmp_path/disk`); checks and closes them at the end."""
    opened: list[DiskBackend] = []

    def _open(layout: KVLayout = SMALL_MHA, cap_gb: float = 0.01,
              root: Path | None = None) -> DiskBackend:
        config = Config(chunk_size=CHUNK, max_local_cpu_size=0.016, max_local_disk_size=cap_gb,
                        local_disk=str(root or tmp_path / "disk"))
        backend = DiskBackend(BackendContext(config=config, layout=layout, allocator=arena))
        opened.append(backend)
        return backend

    yield _open
    for backend in opened:
        backend.check_integrity()
        backend.close()


def redis_backend(url: str, layout: KVLayout = SMALL_MHA, arena_mb: int = 64,
                  **cfg: object) -> RedisBackend:
    """A Redis tier on `url` with its own arena; the caller closes it."""
    cfg = {"remote_timeout_secs": 2.0, **cfg}
    config = Config(chunk_size=16, max_local_cpu_size=arena_mb / 1000, remote_url=url,
                    **cfg)  # type: ignore[arg-type]
    alloc = MemoryAllocator(int(config.max_local_cpu_size * 1e9))
    return RedisBackend(BackendContext(config=config, layout=layout, allocator=alloc))


@pytest.fixture
def make_backend() -> Iterator[Callable[..., RedisBackend]]:
    """`make(url, **config)` -> a Redis tier, closed after the test, which also checks that
    it gave its arena memory back."""
    made: list[RedisBackend] = []

    def make(url: str, **kwargs: object) -> RedisBackend:
        made.append(redis_backend(url, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for backend in made:
        backend.close()
        backend.ctx.allocator.check_integrity()
        assert backend.ctx.allocator.used_bytes == 0, "the redis tier leaked arena memory"
