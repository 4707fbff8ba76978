"""What the disk-tier tests share (the `arena` and `open_disk` fixtures are in conftest.py):
sizes, a put and a check, the record files on disk, and child processes that open the tier."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.backends.disk import DiskBackend
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator, lease
from tests.helpers import SMALL_MHA, put_random, same_bytes

REPO = Path(__file__).resolve().parents[3]
CHUNK = 16
CHUNK_BYTES = SMALL_MHA.nbytes(CHUNK)  # 2 KiB of payload per full chunk
BIG = KVLayout.mha(32, 8, 128, torch.bfloat16)  # Llama-3-8B: 128 KiB a token

Opener = Callable[..., DiskBackend]


def _put(disk: DiskBackend, keys: list[ChunkKey], arena: MemoryAllocator, seed: int = 0,
         layout: KVLayout = SMALL_MHA) -> list[torch.Tensor]:
    return put_random(disk.batch_put, arena, layout, keys, seed)


def _assert_hits(disk: DiskBackend, keys: list[ChunkKey], want: list[torch.Tensor]) -> None:
    with lease(disk.batch_get(keys)) as got:
        assert len(got) == len(keys)
        for obj, expected in zip(got, want, strict=True):
            assert same_bytes(obj.tensor, expected)


def _files(root: Path, pattern: str = "*.kvt") -> list[Path]:
    return sorted(root.glob(f"*/*/{pattern}"))


def _python(code: str) -> subprocess.Popen[str]:
    """Start a Python process running `code` with the repo importable."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


_CHILD_PRELUDE = """
    import sys
    from kvtier.backends import BackendContext
    from kvtier.backends.disk import DiskBackend
    from kvtier.config import Config
    from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease
    from tests.helpers import SMALL_MHA, make_keys, make_obj
    import torch
    def open_disk(root, layout=SMALL_MHA):
        config = Config(chunk_size=16, max_local_cpu_size=0.016, max_local_disk_size=1.0,
                        local_disk=root)
        alloc = MemoryAllocator(int(config.max_local_cpu_size * 1e9))
        return DiskBackend(BackendContext(config=config, layout=layout, allocator=alloc)), alloc
"""


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))
