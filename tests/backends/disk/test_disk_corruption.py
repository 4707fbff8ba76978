"""The disk tier on a real filesystem: corrupt, foreign and vanished records, and failures
(unusable directories, write errors, mismatched objects)."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.backends.disk import DiskBackend
from kvtier.backends.disk import files as rf
from kvtier.backends.disk.backend import DISK_FULL_EVICT_WRITES
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, MemoryObj, lease
from tests.backends.disk.disk_helpers import (
    _CHILD_PRELUDE,
    Opener,
    _assert_hits,
    _files,
    _flip,
    _put,
    _python,
)
from tests.helpers import SMALL_MHA, SMALL_MLA, make_keys, make_obj, same_bytes

# --- corruption --------------------------------------------------------------------------------


CORRUPTIONS: dict[str, Callable[[Path, Path], None]] = {
    "payload_byte": lambda p, other: _flip(p, -5),
    "header_byte": lambda p, other: _flip(p, 30),
    "key_byte": lambda p, other: _flip(p, 90),
    "truncated": lambda p, other: p.write_bytes(p.read_bytes()[:-1]),
    "truncated_header": lambda p, other: p.write_bytes(p.read_bytes()[:40]),
    "zero_length": lambda p, other: p.write_bytes(b""),
    "trailing_bytes": lambda p, other: p.write_bytes(p.read_bytes() + b"\0"),
    "foreign_key": lambda p, other: shutil.copyfile(other, p),
}


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_corrupt_record_is_a_counted_miss_and_deleted(
    open_disk: Opener, damage: str, arena: MemoryAllocator,
) -> None:
    disk = open_disk()
    keys = make_keys(48)
    want = _put(disk, keys, arena)
    victim = disk.path_for(keys[1].key)
    CORRUPTIONS[damage](victim, disk.path_for(keys[2].key))
    with lease(disk.batch_get(keys)) as got:
        assert len(got) == 1 and same_bytes(got[0].tensor, want[0])
    assert not victim.exists()
    stats = disk.stats()
    assert stats["corrupt"] == 1 and stats["entries"] == 2
    assert disk.batch_contains(keys) == 1
    _assert_hits(disk, keys[2:], want[2:])  # neighbours untouched


def _plant(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
@pytest.mark.parametrize("indexed", [True, False])
def test_non_regular_file_at_a_record_path_is_a_counted_miss(
    open_disk: Opener, arena: MemoryAllocator, kind: str, indexed: bool,
) -> None:
    disk = open_disk()
    keys = make_keys(48)
    want = _put(disk, keys, arena)
    victim = disk.path_for(keys[1].key)
    if indexed:  # replaced behind the tier's back
        victim.unlink()
    else:  # another process sharing the directory: never indexed here
        disk.remove(keys[1:])
    _plant(victim, kind)
    got: list[list[MemoryObj]] = []
    reader = threading.Thread(target=lambda: got.append(disk.batch_get(keys)), daemon=True)
    reader.start()
    reader.join(60)  # a hang guard, not a timing: before the fix a FIFO blocked forever
    if reader.is_alive():
        os.close(os.open(victim, os.O_WRONLY | os.O_NONBLOCK))  # release the blocked open
        pytest.fail(f"batch_get blocked on a {kind} at a record path")
    with lease(got[0]) as objs:
        assert len(objs) == 1 and same_bytes(objs[0].tensor, want[0])
    assert disk.batch_contains(keys) == 1
    assert disk.first_held(keys[1:2]) == -1
    assert disk.stats()["not_regular"] >= 1
    assert victim.exists() or victim.is_symlink()  # not ours: left in place
    # A restart does not index it either.
    assert open_disk().stats()["entries"] == (2 if indexed else 1)


def test_wrong_layout_record_is_a_counted_miss_and_deleted(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    keys = make_keys(32)
    _put(open_disk(), keys, arena)
    # An engine with another layout asking for these key strings (e.g. a fingerprint bug).
    other = open_disk(layout=SMALL_MLA)
    assert other.batch_get(keys) == []
    assert other.stats()["corrupt"] == 1
    assert not other.path_for(keys[0].key).exists()
    assert other.path_for(keys[1].key).exists()


def test_files_removed_behind_the_tiers_back_are_misses(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    disk = open_disk()
    keys = make_keys(48)
    _put(disk, keys, arena)
    shutil.rmtree(disk.root)
    assert disk.batch_get(keys) == []
    assert disk.stats()["vanished"] == 1
    assert disk.remove(keys) == 0
    want = _put(disk, keys, arena, seed=5)  # the tree is recreated on demand
    _assert_hits(disk, keys, want)


# --- failures ----------------------------------------------------------------------------------


def test_unusable_directory_is_a_config_error_naming_the_path(
    open_disk: Opener, tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for root in (blocker, blocker / "disk"):
        with pytest.raises(ConfigError, match=str(root)):
            open_disk(root=root)


def test_write_errors_are_dropped_counted_and_serving_goes_on(tmp_path: Path) -> None:
    """A file-size limit makes writes fail with EFBIG, like a full disk fails with ENOSPC."""
    child = _python(_CHILD_PRELUDE + f"""
    import os, resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    disk, alloc = open_disk({str(tmp_path / "disk")!r})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))  # below one 2 KiB record
    keys = make_keys(32)
    objs = [make_obj(alloc, SMALL_MHA, 16, i) for i in range(2)]
    with lease(objs):
        assert disk.batch_put(keys, objs) == 0  # the second chunk would be unreachable
        stats = disk.stats()
        assert stats["write_errors"] == 1 and stats["entries"] == 0, stats
        assert [f for _, _, fs in os.walk(disk.root) for f in fs] == []  # no temp left
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert disk.batch_put(keys, objs) == 2
    assert len(disk.batch_get(keys)) == 2
    print("ok")
    """)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.strip() == "ok"


def _try_put(disk: DiskBackend, keys: list[ChunkKey], arena: MemoryAllocator) -> int:
    objs = [make_obj(arena, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
    with lease(objs):
        return disk.batch_put(keys, objs)


def test_a_full_disk_evicts_some_records_counts_it_and_is_a_miss(
    open_disk: Opener, arena: MemoryAllocator, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 36, item 7: ENOSPC below the cap (the filesystem is shared) freed nothing, so
    every later write failed too. One write's ENOSPC, injected into the real tier's file
    write, evicts DISK_FULL_EVICT_WRITES times its size, least recent first."""
    disk = open_disk(cap_gb=0.01)
    old = [make_keys(16, seed=s) for s in range(8)]  # 8 one-chunk prompts, oldest first
    for seed, keys in enumerate(old):
        _put(disk, keys, arena, seed=seed)
    record = _files(disk.root)[0].stat().st_size
    real, failed = rf._pwrite_all, []

    def full_once(fd: int, data: bytes | memoryview, offset: int) -> None:
        if not failed:
            failed.append(offset)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, offset)

    monkeypatch.setattr(rf, "_pwrite_all", full_once)
    new = make_keys(16, seed=99)
    assert _try_put(disk, new, arena) == 0 and disk.batch_contains(new) == 0  # a miss
    stats = disk.stats()
    assert failed and stats["disk_full"] == 1 and stats["write_errors"] == 1
    assert stats["evictions"] == DISK_FULL_EVICT_WRITES
    assert [disk.batch_contains(keys) for keys in old] == [0] * 4 + [1] * 4
    assert len(_files(disk.root)) == 4 and _files(disk.root, "*.tmp") == []
    assert stats["bytes"] == 4 * record
    _put(disk, new, arena, seed=99)  # the next write fits
    assert disk.batch_contains(new) == 1 and disk.stats()["disk_full"] == 1


def test_other_write_errors_evict_nothing(
    open_disk: Opener, arena: MemoryAllocator, monkeypatch: pytest.MonkeyPatch,
) -> None:
    disk = open_disk(cap_gb=0.01)
    _put(disk, make_keys(16 * 3, seed=1), arena, seed=1)

    def broken(fd: int, data: bytes | memoryview, offset: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(rf, "_pwrite_all", broken)
    assert _try_put(disk, make_keys(16, seed=2), arena) == 0
    stats = disk.stats()
    assert (stats["write_errors"], stats["disk_full"], stats["evictions"]) == (1, 0, 0)
    assert stats["entries"] == 3


def test_put_rejects_mismatched_objects_before_writing(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    disk = open_disk()
    keys = make_keys(32)
    obj = make_obj(arena, SMALL_MHA, 8, 0)
    with lease([obj]):
        with pytest.raises(ValueError, match="objs"):
            disk.batch_put(keys[:1], [obj])
        with pytest.raises(ValueError, match="length"):
            disk.batch_put(keys, [obj])
    assert _files(disk.root, "*") == []
