"""Record keys per tenant through the engine: a request's salt reaches the sealing on the write
path (the disk record opens under its tenant's key, not under the record key itself) and on the
read path (a restarted server loads the tenant's prefix from disk)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvtier.backends import BackendContext
from kvtier.backends.disk import DiskBackend
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.memory import MemoryAllocator, lease
from tests.helpers import same_bytes

SLOTS, CHUNK, LAYERS = 256, 16, 2


def _pool(seed: int | None) -> tuple[SGLangMHAConnector, list[torch.Tensor]]:
    """A pool of random KV (zeros with seed None): its connector and its K then V buffers."""
    gen = torch.Generator().manual_seed(seed or 0)
    bufs = [torch.randn(SLOTS, 2, 8, generator=gen) if seed is not None
            else torch.zeros(SLOTS, 2, 8) for _ in range(2 * LAYERS)]
    return SGLangMHAConnector(bufs[:LAYERS], bufs[LAYERS:]), bufs


def _config(tmp_path: Path) -> Config:
    key_file = tmp_path / "record.key"
    if not key_file.exists():
        key_file.write_bytes(os.urandom(32).hex().encode())
        key_file.chmod(0o600)
    return Config(chunk_size=CHUNK, max_local_cpu_size=0.016, save_tails=False,
                  local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05,
                  record_key_file=str(key_file))


def test_a_tenants_records_are_sealed_and_read_under_its_key(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    tokens = torch.randint(0, 30_000, (4 * CHUNK,), generator=torch.Generator().manual_seed(3))
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(4))[:4 * CHUNK]
    src, src_bufs = _pool(1)
    with CacheEngine(cfg, model_name="m", layout=src.layout, connector=src) as writer:
        assert writer.store(tokens, slots, salt="tenant-a") == 4 * CHUNK
        assert writer.flush(30)
        keys = writer.chunk_keys(tokens, salt="tenant-a")
    assert all(k.salt == "tenant-a" for k in keys)
    # The records on disk: opened for tenant A; the same records read without the salt (under
    # the record key itself) fail their tag, a forged miss.
    disk = DiskBackend(BackendContext(cfg, src.layout, MemoryAllocator(1 << 22)))
    try:
        assert disk.batch_get([k._replace(salt="") for k in keys]) == []
        assert disk.stats()["forged"] == 1 and disk.stats()["corrupt"] == 0
        with lease(disk.batch_get(keys)) as got:
            assert len(got) == 4
    finally:
        disk.close()
    # A restarted server (empty CPU tier) loads A's prefix from disk for A, nothing for B.
    dst, dst_bufs = _pool(None)
    with CacheEngine(cfg, model_name="m", layout=dst.layout, connector=dst) as reader:
        assert reader.lookup(tokens) == 0 and reader.retrieve(tokens, slots, salt="tenant-b") == 0
        assert reader.retrieve(tokens, slots, salt="tenant-a") == 4 * CHUNK
    for got, want in zip(dst_bufs, src_bufs):
        assert same_bytes(got[slots], want[slots])
