"""Records as files: naming, atomic writes, verified reads into the arena, directory scans.

The disk tier (`disk.py`) owns the policy (index, size cap, LRU); this module owns the bytes:

- A record of key string `k` lives at `root/ab/cd/<sha256(k)>.kvt`. Hashing the whole key
  string (namespace included) makes the path a pure function of the key: no listing on lookup.
- It is written to `<stem>.<pid>.<seq>.tmp` next to its final name, locked while in flight;
  the caller `os.replace`s it. Whether a temp file is garbage is told by its lock, never by
  its name (`inflight`: the pid means nothing in another PID namespace).
- It is read with the header first, validated in full, then the payload straight into arena
  memory (encrypted: through a piece of scratch; compressed: decoded into it a piece at a time,
  or, encrypted, after a scratch of the whole verified), verified before it is handed out.
- Privacy: the tree holds every user's prompts. Directories kvtier creates are 0700, records
  0600; a root is refused if it is another user's, writable by others, or reached through a
  symlink (`prepare_root`), and an `ab/cd` directory is used only once checked the same way
  (`RecordDirs`), so nothing another user planted can redirect a write or feed a read.
  Those checks live in kvtier.backends.disk.dirs (re-exported here).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from kvtier.backends.codec import NAIVE, Codec, scratch
from kvtier.backends.disk import inflight
from kvtier.backends.disk.dirs import (
    DIR_MODE,
    FILE_MODE,
    RecordDirs,
    UnsafeDirectory,
    dir_problem,
    prepare_root,
)
from kvtier.backends.disk.paths import SUFFIX, is_temp_name, record_stem
from kvtier.backends.record import (
    RecordHeader,
    RecordKeys,
    Unseal,
    encode_header,
    expected_header_len,
    open_payload,
    parse_header,
    seal_for,
    verify_payload,
)
from kvtier.errors import CorruptEntry
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryObj

__all__ = ["SUFFIX", "file_name", "record_path", "record_file", "temp_path", "write_temp",
           "read_record", "scan", "prepare_root", "RecordDirs", "UnsafeDirectory", "dir_problem",
           "NotRegular", "open_record", "DIR_MODE", "FILE_MODE"]

_HEX = frozenset("0123456789abcdef")
# I/O size: large enough that syscalls are cheap, small enough to stay in the CPU cache
# between checksumming and copying (measured here: ~10% faster puts than hashing 32 MiB first).
PIECE = 1 << 20
# An encrypted read lands each piece in a scratch buffer and decrypts it into the arena: the
# page cache's copy, the scratch and the arena's piece must stay in a core's L2 together.
SEALED_PIECE = 1 << 19
# A plain coded record is read this much of its one-byte values at a time (whole blocks,
# `Codec.blocks`), each decoded into the arena while in the CPU cache (measured here against
# 256 KiB and the whole payload at once: 1 MiB read fastest).
CODED_PIECE = 1 << 20
# From a random start: a server with the same pid in another PID namespace, writing the same
# record, does not pick the same temp name (its O_EXCL would fail: a dropped write).
_SEQ = itertools.count(secrets.randbelow(1 << 48))
# O_NONBLOCK: opening a FIFO must not wait for a writer (harmless on regular files);
# O_NOFOLLOW: a symlink planted at a record path is not a record.
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW


def file_name(key: str) -> str:
    """The record's file stem: the hex SHA-256 of the whole key string."""
    return hashlib.sha256(key.encode()).hexdigest()


def record_path(root: Path, name: str) -> Path:
    return root / name[:2] / name[2:4] / (name + SUFFIX)


def record_file(root: str, name: str) -> str:
    """`record_path` as a string, for lookups that only stat it (a few times cheaper)."""
    return f"{root}{os.sep}{name[:2]}{os.sep}{name[2:4]}{os.sep}{name}{SUFFIX}"


def temp_path(path: Path) -> str:
    """A fresh temp name next to `path`, unique across the threads and tiers of this process."""
    return f"{path.parent / path.stem}.{os.getpid()}.{next(_SEQ)}.tmp"


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(28, "short write")  # ENOSPC in all but name
        view, offset = view[n:], offset + n


def write_temp(dirs: RecordDirs, name: str, tmp: str, key: ChunkKey, obj: MemoryObj,
               stamp_ns: int, keys: RecordKeys | None = None, codec: Codec = NAIVE) -> int:
    """Write the record `name` of `obj` under `key` to the new file `tmp` (0600, in the
    record's directory), with mtime `stamp_ns`; encrypted under `keys.current` with `keys`,
    encoded by `codec` (on the calling writer thread).

    Returns the temp file's descriptor, still locked as in flight (`inflight.create_locked`):
    the caller renames or removes `tmp`, then closes it, so no clean-up takes it meanwhile.

    The payload goes to the file piece by piece, each checksummed (and encrypted into a piece
    buffer) just before it is written, so the kernel copies it from the CPU cache; then the
    header at offset 0. Creates (and checks) the directory on demand. No fsync (see disk.py).

    Raises:
        OSError: the write failed (`UnsafeDirectory`: the directory is not private, nothing
            was created); no temp file is left behind.
    """
    # into this thread's buffer: written out below, before its next record reuses it
    into = None if codec is NAIVE else scratch(codec.stored_nbytes(obj), "write")
    stored_obj = codec.encode(obj, into)  # then the seal, before any file: a ValueError leaves none
    seal = seal_for(key, stored_obj, keys=keys)
    dirs.require(name)
    try:
        fd = inflight.create_locked(tmp, FILE_MODE)
    except FileNotFoundError:  # the tree was removed behind our back: check it anew
        dirs.require(name, recheck=True)
        fd = inflight.create_locked(tmp, FILE_MODE)
    try:
        view = stored_obj.byte_view()
        offset = expected_header_len(key)
        out = memoryview(bytearray(min(PIECE, len(view)))) if seal.encrypted else None
        for start in range(0, len(view), PIECE):
            piece = view[start : start + PIECE]
            stored = seal.update(piece, None if out is None else out[: len(piece)])
            _pwrite_all(fd, stored, offset + start)
        _pwrite_all(fd, encode_header(key, stored_obj, seal=seal), 0)
        os.utime(fd, ns=(stamp_ns, stamp_ns))
    except BaseException:
        with contextlib.suppress(OSError):  # in a checked directory: no redirect to fear
            os.unlink(tmp)
        os.close(fd)
        raise
    return fd


class NotRegular(OSError):
    """What sits at a record path is not a record file of ours (`what` says why): a FIFO,
    device, directory or symlink, or it is in a directory that is not private."""

    def __init__(self, what: str) -> None:
        super().__init__(errno.EPERM, what)
        self.what = what


def open_record(dirs: RecordDirs, name: str) -> tuple[int, os.stat_result]:
    """Open record `name` for reading: never blocking (a FIFO), never through a symlink at the
    record path, and only a regular file in a private directory. The directory is checked
    after the open, so a miss costs one syscall, and a hit in a checked directory none more.

    Returns the fd (the caller's to close) and its `fstat`.

    Raises:
        NotRegular: something else is there (left in place; nothing was read).
        OSError: no record there (`FileNotFoundError`), or the open failed.
    """
    try:
        fd = os.open(record_path(dirs.root, name), _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise NotRegular("a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        why = dirs.problem(name)
        if why is None and not stat.S_ISREG(st.st_mode):
            why = f"mode {stat.S_IFMT(st.st_mode):o}"
        if why is not None:
            raise NotRegular(why)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_record(fd: int, size: int, key: ChunkKey, layout: KVLayout,
                allocate: Callable[[int], MemoryObj | None],
                keys: RecordKeys | None = None) -> MemoryObj | None:
    """Read and verify the record in `fd` (`size` bytes) into a new arena object (decrypted
    into it if encrypted; `keys`: the reader's record keys; not naive: verified in a scratch
    buffer, then decoded into it). Returns the object (the caller owns its one reference), or
    None when the arena is full.

    Raises:
        CorruptEntry: any field, length or checksum mismatch; no object is left allocated.
            `ForgedEntry` if `keys` may not load it (`KeyMismatch`: known before any
            allocation) or its GCM tag fails.
        OSError: the read failed.
    """
    header = parse_header(os.pread(fd, expected_header_len(key), 0), key, layout)
    if size != header.header_len + header.payload_len:
        raise CorruptEntry(f"file size {size} != header + payload "
                           f"{header.header_len + header.payload_len}")
    unseal = open_payload(header, keys)
    obj = allocate(key.num_tokens)
    if obj is None:
        return None
    try:
        blocks = None if header.codec is NAIVE or unseal.encrypted else header.codec.blocks(obj)
        if blocks is not None:
            _read_coded(fd, header, unseal, obj, blocks)
            return obj
        view = obj.byte_view() if header.codec is NAIVE else scratch(header.payload_len)
        pos, step = 0, SEALED_PIECE if unseal.encrypted else PIECE
        while pos < len(view):  # piece by piece, each verified while still in the cache
            piece = view[pos : pos + step]
            stored = unseal.landing(piece)
            n = os.preadv(fd, [stored], header.header_len + pos)
            if n <= 0:
                raise CorruptEntry(f"truncated: payload ends after {pos} of {len(view)} bytes")
            unseal.update(stored[:n], piece[:n])
            pos += n
        verify_payload(header, view, unseal=unseal)
        if header.codec is not NAIVE:
            header.codec.decode(view, obj)
    except BaseException:
        obj.release()
        raise
    return obj


def _read_coded(fd: int, header: RecordHeader, unseal: Unseal, obj: MemoryObj,
                blocks: tuple[int, int]) -> None:
    """Read the plain coded payload of `header` from `fd` and decode it into `obj`: the scales
    (the payload's tail) first, then a piece of whole blocks at a time, checksummed and decoded
    while in the CPU cache, then verified whole (`unseal.finish`). Until then `obj` holds
    unverified KV: the caller releases it on any exception, as a naive read does."""
    block, count = blocks
    step = max(1, CODED_PIECE // block)
    base, values = header.header_len, block * count
    tail = scratch(header.payload_len - values, "scales")
    _pread_all(fd, tail, base + values)
    buf = scratch(step * block)
    for first in range(0, count, step):
        piece = buf[: min(step, count - first) * block]
        _pread_all(fd, piece, base + first * block)
        unseal.update(piece)
        header.codec.decode_blocks(piece, tail, obj, first)
    unseal.update(tail)
    unseal.finish(header.checksum)


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], offset + pos)
        if n <= 0:
            raise CorruptEntry(f"truncated: {len(view) - pos} bytes missing at {offset + pos}")
        pos += n


def _private(entry: os.DirEntry[str]) -> bool:
    try:
        return dir_problem(entry.stat(follow_symlinks=False)) is None
    except FileNotFoundError:  # removed meanwhile by a process sharing the directory
        return False


def _subdirs(path: Path | str, check: bool) -> list[str]:
    with os.scandir(path) as it:
        return [e.path for e in it
                if len(e.name) == 2 and set(e.name) <= _HEX and e.is_dir(follow_symlinks=False)
                and (not check or _private(e))]


def scan(root: Path, dirs: RecordDirs | None = None) -> tuple[list[tuple[int, str, int]], int]:
    """Every record under `root` as (mtime ns, stem, size), oldest first, from directory
    entries and `stat` only (no file is opened; only regular files named as records in their
    `ab/cd` count: `paths.record_stem`); removes stale temp files (named as `paths.is_temp_name`
    says, and garbage as `inflight.remove_stale` tells: never one in flight).
    Symlinked directories are never entered; with `dirs`, neither are directories that are not
    private (`dir_problem`), and the others are marked in `dirs`.

    Returns the records and how many temp files were removed.
    """
    found: list[tuple[int, str, int]] = []
    removed = 0
    for top in _subdirs(root, dirs is not None):
        for sub in _subdirs(top, dirs is not None):
            if dirs is not None:
                dirs.mark(os.path.basename(top) + os.path.basename(sub))
            names = os.path.basename(top), os.path.basename(sub)
            with os.scandir(sub) as it:
                for entry in it:
                    try:
                        if (stem := record_stem(entry.name, *names)) is not None:
                            if not entry.is_file(follow_symlinks=False):
                                continue  # a FIFO, device, directory or symlink: not a record
                            st = entry.stat(follow_symlinks=False)
                            found.append((st.st_mtime_ns, stem, st.st_size))
                        elif is_temp_name(entry.name, *names) and inflight.remove_stale(
                                entry.path):
                            removed += 1
                    except FileNotFoundError:
                        pass  # deleted meanwhile by a process sharing the directory
    found.sort()
    return found, removed
