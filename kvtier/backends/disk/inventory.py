"""The disk tier's records listed and deleted from the config alone (`kvtier ls/purge`), and
what it holds counted without opening it (`kvtier info`: the tier's start-up would create a
missing root, write a probe and remove stale temp files).

Only what the tier itself would use is looked at, and deleted: a root that is not the
filesystem root, a home or system directory, nor reached through a symlink (`ConfigError`
naming `local_disk`), and under it only files named as records in private `ab/cd`
directories, read (each record's header: its key string, checksummed) and unlinked without
following a symlink (`paths`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvtier.backends.disk import files as rf
from kvtier.backends.disk import paths
from kvtier.backends.disk.owners import read_record_key
from kvtier.backends.inventory import RecordInventory, StoredRecord
from kvtier.config import Config
from kvtier.config.names import DISK
from kvtier.errors import ConfigError

__all__ = ["DiskInventory", "disk_root"]


def disk_root(path: Path) -> Path:
    """The disk tier's root `path` made absolute; `ConfigError` naming `local_disk` when the
    tier would refuse it (`paths.root_problem`, a symlink on the way)."""
    root = Path(os.path.abspath(path))
    why = paths.root_problem(root)
    link = paths.first_symlink(root)
    if why is None and link is not None:
        why = f"goes through the symlink {link}"
    if why is not None:
        raise ConfigError(f"local_disk: {root} {why}; the disk tier refuses it, and kvtier "
                          "lists and deletes nothing there")
    return root


class DiskInventory(RecordInventory):
    @classmethod
    def peek(cls, config: Config) -> dict[str, float] | None:
        assert config.local_disk_path is not None
        root = _usable_root(Path(os.path.abspath(config.local_disk_path)))
        entries = size = 0
        for top in os.scandir(root):  # root/ab/cd/<stem>.kvt, as the record files lie
            if not top.is_dir(follow_symlinks=False):
                continue
            for sub in os.scandir(top.path):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                for entry in os.scandir(sub.path):
                    if entry.name.endswith(rf.SUFFIX) and entry.is_file(follow_symlinks=False):
                        entries += 1
                        size += entry.stat(follow_symlinks=False).st_size
        return {"entries": entries, "bytes": size,
                "capacity_bytes": config.max_local_disk_size * 1e9}

    def records(self, namespace: str) -> Iterator[StoredRecord]:
        # Every record file: a namespace is read from each header (the caller selects).
        assert self.config.local_disk_path is not None
        root = disk_root(self.config.local_disk_path)
        if not root.is_dir():
            return
        dirs = rf.RecordDirs(root)
        found, _ = rf.scan(root, dirs)  # never enters a directory that is not private
        for _, name, size in found:
            try:  # O_NOFOLLOW | O_NONBLOCK, regular files only
                key = read_record_key(dirs, name) or "corrupt"  # corrupt: listed as model "?"
            except rf.NotRegular:
                continue  # not a record file of ours: neither listed nor deleted
            except OSError:
                continue  # gone meanwhile
            yield StoredRecord(DISK, key, size, (str(rf.record_path(root, name)),))

    def delete(self, records: Sequence[StoredRecord]) -> list[StoredRecord]:
        gone = []
        for record in records:
            path = Path(record.location[0])
            if paths.unlink_record(path.parents[2], path.name):
                gone.append(record)  # else gone meanwhile, or no longer a record file of ours
        return gone


def _usable_root(root: Path) -> Path:
    """`root`, or `OSError` saying why the disk tier could not use it (looked at only)."""
    if not os.path.lexists(root):
        raise OSError(f"{root} does not exist (the server creates it at its first start)")
    current = Path(root.anchor)
    for part in root.parts[1:]:  # the tier refuses a symlink anywhere on the path
        current /= part
        if stat.S_ISLNK(os.lstat(current).st_mode):
            raise OSError(f"{root} goes through the symlink {current}, which the disk tier "
                          "refuses")
    why = paths.root_problem(root) or rf.dir_problem(os.lstat(root))
    if why is not None:
        raise OSError(f"{root} {why}")
    if not os.access(root, os.W_OK | os.X_OK):
        raise OSError(f"{root} is not writable by this user")
    return root
