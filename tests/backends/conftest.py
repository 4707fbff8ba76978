"""The `backend` fixture: every storage tier behind one conformance suite.

To add a tier, add its name to BACKEND_NAMES and a branch to `_config_for`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.backends import BackendContext, StorageBackend, create_backend
from kvtier.config import Config
from kvtier.memory import MemoryAllocator
from tests.helpers import SMALL_MHA

BACKEND_NAMES = ["cpu", "disk", "redis"]


def _config_for(name: str, request: pytest.FixtureRequest) -> Config:
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
    backend = create_backend(request.param, ctx)
    try:
        yield backend, ctx
    finally:
        backend.close()
    alloc.check_integrity()
    assert alloc.used_bytes == 0, "a backend leaked arena memory"
