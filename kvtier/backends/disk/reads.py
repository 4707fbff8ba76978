"""The disk tier's reads: read-ahead on a small thread pool, one record read and verified into
the arena, and what a failed read does (a miss counted; a corrupt record deleted, a forged one
or another kvtier format's left in place, see kvtier.backends.disk.backend's module doc).

`DiskReads` is a mixin of `DiskBackend`, which sets the attributes declared below in its
constructor and provides the methods declared below it; the lock, index and counters are the
backend's, shared with its writes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kvtier.backends.base import BackendContext
from kvtier.backends.disk import files as rf
from kvtier.backends.disk.index import DiskIndex
from kvtier.backends.record import ForgedEntry, OtherVersion, RecordKeys
from kvtier.background import name_os_thread
from kvtier.errors import CorruptEntry
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj
from kvtier.metrics import Counters, RateLimitedLog

__all__ = ["DiskReads", "READ_AHEAD"]


READ_AHEAD = 4  # chunk reads in flight per batch: keeps the device queue busy while a chunk
# is checksummed or copied on, without holding much arena for a prefix that may miss early


class DiskReads:
    """`batch_get` / `iter_get` of the disk tier (see the module doc)."""

    # Set by DiskBackend.__init__.
    root: Path
    ctx: BackendContext
    _dirs: rf.RecordDirs
    _keys: RecordKeys | None
    _lock: threading.Lock
    _index: DiskIndex
    _counts: Counters
    _warn: RateLimitedLog
    _closed: bool
    _read_pool: ThreadPoolExecutor | None

    # Provided by DiskBackend.
    def _touch(self, keys: Sequence[ChunkKey], persist: bool = False) -> None:
        raise NotImplementedError

    def _adopt_locked(self, name: str, size: int, key: str) -> None:
        raise NotImplementedError

    def _unlink(self, path: Path) -> bool:
        raise NotImplementedError

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        return list(self.iter_get(keys))

    def iter_get(self, keys: Sequence[ChunkKey]) -> Generator[MemoryObj, None, None]:
        """Reads up to `READ_AHEAD` records at once on a small thread pool and yields them in
        order. Read-ahead starts after the first hit, so a prefix that misses at once costs
        one read."""
        pool = self._pool()
        ahead: deque[Future[MemoryObj | None]] = deque(
            pool.submit(self._get_one, key) for key in keys[:1])
        hits = 0
        try:
            while ahead:
                obj = ahead.popleft().result()
                if obj is None:
                    break
                hits += 1
                while len(ahead) < READ_AHEAD and hits + len(ahead) < len(keys):
                    ahead.append(pool.submit(self._get_one, keys[hits + len(ahead)]))
                yield obj
        finally:
            for future in ahead:  # read ahead of a miss, or of a caller that stopped early
                if not future.cancel():
                    late = future.result()
                    if late is not None:
                        late.release()
            with self._lock:
                self._counts.inc("hits", hits)
                self._counts.inc("misses", int(hits < len(keys)))
            self._touch(keys[:hits], persist=True)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="kvtier-disk",
                                                     initializer=name_os_thread)
            return self._read_pool

    def _get_one(self, key: ChunkKey) -> MemoryObj | None:
        name = rf.file_name(key.key)
        path = rf.record_path(self.root, name)
        with self._lock:
            if self._closed:
                return None
            self._index.pin(name)
        try:
            fd, st = rf.open_record(self._dirs, name)
        except OSError as exc:
            self._unpin(name, vanished=isinstance(exc, FileNotFoundError))
            if isinstance(exc, rf.NotRegular):
                self._not_regular(name, path, exc.what)
            elif not isinstance(exc, FileNotFoundError):
                self._read_error(path, exc)
            return None
        try:
            obj = rf.read_record(fd, st.st_size, key, self.ctx.layout, self.ctx.allocate,
                                 self._keys)
            if obj is None:
                self._counts.inc("alloc_failures")
            else:
                with self._lock:
                    self._adopt_locked(name, st.st_size, key.key)
            return obj
        except CorruptEntry as exc:
            self._discard(name, path, st, exc)
            return None
        except OSError as exc:
            self._read_error(path, exc)
            return None
        finally:
            os.close(fd)
            self._unpin(name)

    def _unpin(self, name: str, vanished: bool = False) -> None:
        with self._lock:
            self._index.unpin(name)
            # Gone behind our back, unless a writer put it back since (else the cap misses it).
            gone = vanished and not os.path.lexists(rf.record_path(self.root, name))
            if gone and name in self._index:
                self._index.forget(name)
                self._counts.inc("vanished")

    def _not_regular(self, name: str, path: Path, what: str) -> None:
        """A FIFO, device, directory or symlink sits at a record path, or its directory is not
        private: a miss; not ours to delete."""
        with self._lock:
            self._counts.inc("not_regular")
            self._index.forget(name)
        self._warn.warning("not_regular", "kvtier disk: %s is not a record file of ours (%s); "
                           "treated as a miss", path, what)

    def _read_error(self, path: Path, exc: OSError) -> None:
        self._counts.inc("read_errors")
        self._warn.warning("read", "kvtier disk: cannot read %s: %s", path, exc)

    def _discard(self, name: str, path: Path, st: os.stat_result, exc: CorruptEntry) -> None:
        """Delete a corrupt record, unless a writer has replaced it meanwhile; a forged one
        (another record key's, or none) is a miss left in place (`record.ForgedEntry`)."""
        if isinstance(exc, (ForgedEntry, OtherVersion)):
            what = "forged" if isinstance(exc, ForgedEntry) else "other_version"
            self._counts.inc(what)
            self._warn.warning(what, "kvtier disk: %s: %s; a miss (left in place)", path, exc)
            return
        with self._lock:
            self._counts.inc("corrupt")
            self._index.forget(name)
            with contextlib.suppress(OSError):
                now = os.stat(path)
                if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                    self._unlink(path)
        self._warn.warning("corrupt", "kvtier disk: deleted corrupt record %s: %s", path, exc)
