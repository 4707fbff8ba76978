"""The disk tier: one checksummed record file per chunk, persistent across restarts.

Files, their format and their privacy are `files.py`'s business, the index `index.py`'s (LRU,
or `frequency.py`'s order under `eviction_policy: lfuda`),
whose record is whose `owners.py`'s; reads are `reads.py`'s (`DiskReads`, a mixin of
`DiskBackend`); this module keeps the cap, the lock, the counters and the writes.

- Persistence: the index is rebuilt at start-up from directory entries (mtime = recency); a
  miss in the index is checked against the filesystem, so a process sharing the directory
  sees new records without a restart. Each put or hit stamps its batch so that the first
  chunk is the newest: LRU eviction takes suffixes before prefixes; a record being read is
  never evicted.
- The cap counts, and eviction takes, only the records of this tier's namespace and model:
  servers of other models sharing the directory never lose a record to it. Opening deletes
  nothing; over its cap, each write shrinks the tier by at most `SHRINK_WRITES` times its size;
  ENOSPC (the filesystem full below the cap) evicts `DISK_FULL_EVICT_WRITES` times it.
- No fsync: a killed process loses nothing the kernel has; a torn file after a power loss is
  a checksum failure, a counted miss.
- Failures never raise: a failed write is a counted miss; a corrupt record is counted,
  deleted, a miss. A forged record (`record.ForgedEntry`) or one of another kvtier format
  (`record.OtherVersion`) is a counted miss left in place.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier.backends import base
from kvtier.backends.base import BackendContext, ProbeSample, StorageBackend
from kvtier.backends.disk import files as rf
from kvtier.backends.disk.evictions import EvictionNotes
from kvtier.backends.disk.index import DiskIndex
from kvtier.backends.disk.owners import identify, learn_in_background, owner_of
from kvtier.backends.disk.probe import probe_disk
from kvtier.backends.disk.reads import READ_AHEAD, DiskReads
from kvtier.backends.disk.root import open_root
from kvtier.backends.record import expected_header_len
from kvtier.config.names import DISK
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj
from kvtier.metrics import RateLimitedLog

__all__ = ["DiskBackend", "READ_AHEAD"]

logger = logging.getLogger(__name__)

_COUNTERS = ("hits", "misses", "puts", "put_bytes", "evictions", "corrupt", "forged", "vanished",
             "adopted", "write_errors", "write_dropped", "read_errors", "alloc_failures",
             "stale_tmp_removed", "not_regular", "disk_full", "other_version")
DISK_FULL_EVICT_WRITES = 4  # ENOSPC frees room for the next few writes, not half the cache
SHRINK_WRITES = 4  # over its cap, a write evicts at most this many times its own size


class DiskBackend(DiskReads, StorageBackend):
    """Chunks as files under `config.local_disk`, at most `max_local_disk_size` GB in total."""

    name = DISK

    def __init__(self, ctx: BackendContext):
        root = ctx.config.local_disk_path
        if root is None:
            raise ConfigError("local_disk: must be set to use the disk tier")
        self.root = Path(os.path.abspath(root))  # what is checked is what is used, whatever the cwd
        self._root_str = str(self.root)
        self._dirs = rf.RecordDirs(self.root)
        self.capacity = int(ctx.config.max_local_disk_size * 1e9)
        self.ctx = ctx  # public: the layout and arena its records are read into
        self._keys = ctx.record_key
        self._lock = threading.Lock()  # one index change and its file change are one step
        self._index = DiskIndex(self.capacity, lambda name: identify(self._dirs, name),
                                lambda key: rf.file_name(key.key), ctx.config.tenant_max_fraction,
                                ctx.config.eviction_policy)
        self._counts = ctx.counters.scope(self.name, *_COUNTERS)
        self._notes = EvictionNotes(self.name)  # keys of what it writes, while watched
        self._warn = RateLimitedLog(logger)
        self._closed = False
        self._read_pool: ThreadPoolExecutor | None = None  # made on the first read
        start = time.perf_counter()
        found, stale = open_root(self.root, root, self._dirs)
        self._counts.inc("stale_tmp_removed", stale)
        self._index.load(found)
        self._stop = threading.Event()
        self._learning = False
        if self._index.bytes > self.capacity:
            logger.warning("kvtier disk: %s holds %.2f GB, over max_local_disk_size (%.2f GB);"
                           " nothing is deleted now: this tier shrinks its own model's records "
                           "as it writes, never other models' or namespaces'", root,
                           self._index.bytes / 1e9, self.capacity / 1e9)
        logger.info("kvtier disk: %s holds %d records (%.2f of %.2f GB), indexed in %.2fs",
                    root, len(self._index), self._index.bytes / 1e9, self.capacity / 1e9,
                    time.perf_counter() - start)

    def path_for(self, key: str) -> Path:
        """Where the record of key string `key` lives (whether or not it exists)."""
        return rf.record_path(self.root, rf.file_name(key))

    def _stamps(self, n: int) -> list[int]:
        with self._lock:
            return self._index.stamps(n)

    def _touch(self, keys: Sequence[ChunkKey], persist: bool = False, use: bool = True) -> None:
        """Mark `keys` (a prefix, in order) used, the first as the newest (without `use`, a
        batch just stored: reordered, not counted again); with `persist`, in the files' mtimes
        too, so that the order survives a restart."""
        with self._lock:
            self._index.touch((rf.file_name(key.key) for key in keys), use)
        if persist:
            for key, stamp in zip(keys, self._stamps(len(keys)), strict=True):
                with contextlib.suppress(OSError):  # a file gone meanwhile does not matter
                    os.utime(self.path_for(key.key), ns=(stamp, stamp))

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        # Noted without the lock (held by writes over file changes): its next holder applies it.
        if keys and not self._closed:
            self._index.note(tuple(keys))

    def _adopt_locked(self, name: str, size: int, key: str) -> None:
        if self._index.adopt(name, size, owner_of(key)):
            self._counts.inc("adopted")

    def _make_room_locked(self, need: int) -> bool:
        victims = self._index.victims(need, SHRINK_WRITES)
        if victims is None:
            return False
        self._evict_locked(victims)
        return True

    def watch_evictions(self, watch: base.EvictionWatch) -> None:
        self._notes.watch = watch

    def _evict_locked(self, names: list[str]) -> int:  # forget, delete, count, tell; how many
        for name in names:
            self._index.forget(name, evicted=True)
            self._delete(name)
        self._counts.inc("evictions", len(names))
        self._notes.evicted(names)
        return len(names)

    def _delete(self, name: str) -> bool:
        """Unlink record `name`, unless its directory is not private (nothing there is ours)."""
        return self._dirs.problem(name) is None and self._unlink(rf.record_path(self.root, name))

    def _unlink(self, path: Path) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._warn.warning("unlink", "kvtier disk: cannot delete %s: %s", path, exc)
            return False

    def probe(self, nbytes: int) -> list[ProbeSample]:
        if self._closed or nbytes <= 0:
            return []
        return [probe_disk(self.root, nbytes)]

    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            if self._closed:
                return 0
            return next((i for i, key in enumerate(keys) if not self._held_locked(key.key)),
                        len(keys))

    def first_held(self, keys: Sequence[ChunkKey]) -> int:
        # A prefix's candidate tails are many (one per page of a chunk): one lock for all.
        with self._lock:
            if self._closed:
                return -1
            return next((i for i, key in enumerate(keys) if self._held_locked(key.key)), -1)

    def _held_locked(self, key: str) -> bool:
        """Whether the record of `key` is indexed, or on disk (another process wrote it: it
        is adopted into the index)."""
        name = rf.file_name(key)
        if name in self._index:
            return True
        try:
            st = os.lstat(rf.record_file(self._root_str, name))
        except OSError:
            return False
        # Checked after the lstat, so a miss costs nothing more.
        if not stat.S_ISREG(st.st_mode) or self._dirs.problem(name) is not None:
            self._counts.inc("not_regular")
            return False
        self._adopt_locked(name, st.st_size, key)
        return True

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        base.check_batch(keys, objs, self.ctx.layout)
        stored = 0
        # A chunk after a failed one would be unreachable: the batch stops at the first failure.
        for key, obj, stamp in zip(keys, objs, self._stamps(len(keys)), strict=True):
            if not self._put_one(key, obj, stamp):
                break
            stored += 1
        self._touch(keys[:stored], use=False)
        return stored

    def _put_one(self, key: ChunkKey, obj: MemoryObj, stamp: int) -> bool:
        name = rf.file_name(key.key)
        path = rf.record_path(self.root, name)
        size = expected_header_len(key) + self.ctx.codec.stored_nbytes(obj)  # as written
        owner = owner_of(key.key)
        # The chain, where the order keeps prefixes whole: a hash, so only then.
        parent = rf.file_name(key.prev) if key.prev is not None and self._index.chained else None
        with self._lock:
            if self._closed:
                return False
            if owner is not None:
                self._index.claim(owner)
            if not self._learning:  # the owners' scan: once, with the first write
                self._learning = True
                learn_in_background(self._dirs, self._index.unknown_owners(),
                                    self._index.set_owner, self._lock, self._stop)
            if not self._make_room_locked(size):
                self._counts.inc("write_dropped")
                self._warn.warning("full", "kvtier disk: no room for %d bytes under the cap of "
                                   "%d (records busy or too large); write dropped", size,
                                   self.capacity)
                return False
            self._index.reserved += size
        tmp = rf.temp_path(path)
        fd, committed = -1, False
        try:
            # leaves nothing on failure; else holds the temp file's lock until it is renamed
            fd = rf.write_temp(self._dirs, name, tmp, key, obj, stamp, self._keys, self.ctx.codec)
            with self._lock:
                if not self._closed:
                    os.replace(tmp, path)
                    committed = True
                    self._index.put(name, size, owner, parent)
                    self._notes.wrote(name, key.key)
                    self._counts.inc("puts")
                    self._counts.inc("put_bytes", size)
        except OSError as exc:
            self._counts.inc("write_errors")
            self._warn.warning("write", "kvtier disk: write to %s failed, dropped: %s", tmp, exc)
            if exc.errno == errno.ENOSPC:  # full below the cap: others' files, a small disk
                with self._lock:
                    self._counts.inc("disk_full")
                    self._evict_locked(self._index.oldest(DISK_FULL_EVICT_WRITES * size))
        finally:
            with self._lock:
                self._index.reserved -= size
            if fd >= 0:
                if not committed:
                    self._unlink(Path(tmp))
                os.close(fd)
        return committed

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        names = [rf.file_name(key.key) for key in keys]
        removed = 0
        # Unlink under the lock, so a concurrent put of the same key keeps its new file.
        with self._lock:
            if not self._closed:
                for name in names:
                    self._index.forget(name)
                    removed += self._delete(name)
                self._notes.forget(names)  # its caller tells the watchers
        return removed

    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {"entries": len(self._index), "bytes": self._index.bytes,
                                     "capacity_bytes": self.capacity}
        return {**self._counts.snapshot(declared=True), **out}

    def check_integrity(self) -> None:
        """Raise `AssertionError` unless the byte count matches the index (for tests)."""
        with self._lock:
            self._index.check()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._closed = True
            pool, self._read_pool = self._read_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
