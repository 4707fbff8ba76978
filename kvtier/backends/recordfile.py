"""Records as files: naming, atomic writes, verified reads into the arena, directory scans.

The disk tier (`disk.py`) owns the policy (index, size cap, LRU); this module owns the bytes:

- A record of key string `k` lives at `root/ab/cd/<sha256(k)>.kvt`. Hashing the whole key
  string (namespace included) makes the path a pure function of the key: no listing on lookup.
- It is written to `<stem>.<pid>.<seq>.tmp` next to its final name; the caller `os.replace`s it.
  A temp file whose pid is dead (or that is older than STALE_TMP_SECS) is garbage.
- It is read with the header first, validated in full, then the payload straight into arena
  memory and verified against its checksum before the object is handed out.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.backends.record import (
    encode_header,
    expected_header_len,
    parse_header,
    payload_hasher,
    verify_payload,
)
from kvtier.errors import CorruptEntry
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryObj

__all__ = ["SUFFIX", "file_name", "record_path", "temp_path", "write_temp", "read_record",
           "scan", "probe_writable"]

SUFFIX = ".kvt"
STALE_TMP_SECS = 3600.0  # older than this, a temp file is garbage even if its pid was reused
_HEX = frozenset("0123456789abcdef")
# I/O size: large enough that syscalls are cheap, small enough to stay in the CPU cache
# between checksumming and copying (measured here: ~10% faster puts than hashing 32 MiB first).
PIECE = 1 << 20
_SEQ = itertools.count()
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def file_name(key: str) -> str:
    """The record's file stem: the hex SHA-256 of the whole key string."""
    return hashlib.sha256(key.encode()).hexdigest()


def record_path(root: Path, name: str) -> Path:
    return root / name[:2] / name[2:4] / (name + SUFFIX)


def temp_path(path: Path) -> str:
    """A fresh temp name next to `path`, unique across the threads and tiers of this process."""
    return f"{path.parent / path.stem}.{os.getpid()}.{next(_SEQ)}.tmp"


def probe_writable(root: Path) -> None:
    """Create `root` if needed and write a file in it; `OSError` if either fails."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f".probe.{os.getpid()}.tmp"
    with open(probe, "wb") as f:
        f.write(b"kvtier")
    probe.unlink()


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(28, "short write")  # ENOSPC in all but name
        view, offset = view[n:], offset + n


def write_temp(tmp: str, key: ChunkKey, obj: MemoryObj, stamp_ns: int) -> None:
    """Write the record of `obj` under `key` to the new file `tmp`, with mtime `stamp_ns`.

    The payload goes straight from arena memory to the file (no copy), piece by piece, each
    piece checksummed just before it is written so the kernel copies it from the CPU cache;
    the header follows at offset 0. Creates the directory on demand. No fsync (see disk.py).

    Raises:
        OSError: the write failed; `tmp` may exist and is the caller's to remove.
    """
    try:
        fd = os.open(tmp, _WRITE_FLAGS, 0o644)
    except FileNotFoundError:  # first record in this directory, or the tree was removed
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        fd = os.open(tmp, _WRITE_FLAGS, 0o644)
    try:
        view = obj.byte_view()
        offset = expected_header_len(key)
        hasher = payload_hasher()
        for start in range(0, len(view), PIECE):
            piece = view[start : start + PIECE]
            hasher.update(piece)
            _pwrite_all(fd, piece, offset + start)
        _pwrite_all(fd, encode_header(key, obj, checksum=hasher.intdigest()), 0)
        os.utime(fd, ns=(stamp_ns, stamp_ns))
    finally:
        os.close(fd)


def read_record(fd: int, size: int, key: ChunkKey, layout: KVLayout,
                allocate: Callable[[int], MemoryObj | None]) -> MemoryObj | None:
    """Read and verify the record in `fd` (`size` bytes) into a new arena object.

    Returns the object (the caller owns its one reference), or None when the arena is full.

    Raises:
        CorruptEntry: any field, length or checksum mismatch; no object is left allocated.
        OSError: the read failed.
    """
    header = parse_header(os.pread(fd, expected_header_len(key), 0), key, layout)
    if size != header.header_len + header.payload_len:
        raise CorruptEntry(f"file size {size} != header + payload "
                           f"{header.header_len + header.payload_len}")
    obj = allocate(key.num_tokens)
    if obj is None:
        return None
    try:
        view = obj.byte_view()
        hasher = payload_hasher()
        pos = 0
        while pos < len(view):  # piece by piece, each checksummed while still in the cache
            piece = view[pos : pos + PIECE]
            n = os.preadv(fd, [piece], header.header_len + pos)
            if n <= 0:
                raise CorruptEntry(f"truncated: payload ends after {pos} of {len(view)} bytes")
            hasher.update(piece[:n])
            pos += n
        verify_payload(header, view, checksum=hasher.intdigest())
    except BaseException:
        obj.release()
        raise
    return obj


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _stale_tmp(entry: os.DirEntry[str]) -> bool:
    parts = entry.name.split(".")  # <stem>.<pid>.<seq>.tmp
    if len(parts) != 4 or not parts[1].isdigit():
        return False  # not ours: leave it alone
    pid = int(parts[1])
    age = time.time() - entry.stat().st_mtime
    # Our own pid counts as alive: another tier instance in this process may be writing it.
    return not _pid_alive(pid) or age > STALE_TMP_SECS


def _subdirs(path: Path | str) -> list[str]:
    with os.scandir(path) as it:
        return [e.path for e in it
                if len(e.name) == 2 and set(e.name) <= _HEX and e.is_dir(follow_symlinks=False)]


def scan(root: Path) -> tuple[list[tuple[int, str, int]], int]:
    """Every record under `root` as (mtime ns, stem, size), oldest first, from directory
    entries and `stat` only (no file is opened; only regular files count); removes stale temp
    files on the way.

    Returns the records and how many temp files were removed.
    """
    found: list[tuple[int, str, int]] = []
    removed = 0
    for top in _subdirs(root):
        for sub in _subdirs(top):
            with os.scandir(sub) as it:
                for entry in it:
                    try:
                        if entry.name.endswith(SUFFIX):
                            if not entry.is_file(follow_symlinks=False):
                                continue  # a FIFO, device, directory or symlink: not a record
                            st = entry.stat(follow_symlinks=False)
                            found.append((st.st_mtime_ns, entry.name[: -len(SUFFIX)],
                                          st.st_size))
                        elif entry.name.endswith(".tmp") and _stale_tmp(entry):
                            os.unlink(entry.path)
                            removed += 1
                    except FileNotFoundError:
                        pass  # deleted meanwhile by a process sharing the directory
    found.sort()
    return found, removed
