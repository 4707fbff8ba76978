"""Files the disk tier has in flight (record temp files, probe files) and when one is garbage.

A writer creates its file (`create_locked`: `O_EXCL`, never through a symlink) and at once
takes an exclusive `flock` on it, which it holds until the file has its final name or is
gone. The kernel drops the lock when the writer's last descriptor closes, however the process
ends (SIGKILL included). Clean-up (`remove_stale`) deletes a file only when it is a regular
file, unchanged for `GRACE_S`, and its lock can be taken without waiting: a file whose writer
lives is never deleted, and nothing is deleted because of how its name reads.

- Why a lock, not the writer's pid in the name: pids belong to a PID namespace. Servers in
  containers that share the directory see each other's pids as dead (or as some unrelated
  live process), so a pid check deleted a live writer's temp file; a pid past a C long made
  `os.kill` raise. A lock is kept by the kernel with the file, for every process on the host.
- Why `flock`, not `fcntl`/`lockf` record locks: those belong to the process, so a clean-up
  in the writer's own process would take them (no conflict within a process) and, closing its
  descriptor, drop the writer's. `flock` locks belong to the open file description: another
  open of the file conflicts, in this process or any other.
- Why the grace: a file exists a few microseconds before it is locked, and kvtier before this
  version did not lock at all; no write lasts `GRACE_S` unlocked. (On NFS, Linux emulates
  `flock` with record locks, so within one process only the grace protects a write.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time

__all__ = ["GRACE_S", "create_locked", "remove_stale"]

GRACE_S = 60.0
# O_NOFOLLOW: never create through a symlink planted at the name; O_EXCL: never an existing file.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_PEEK = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW


def create_locked(path: str | os.PathLike[str], mode: int = 0o600) -> int:
    """Create the file `path` for writing, locked as in flight (see the module docstring).

    Returns its descriptor: the caller renames or removes the file, then closes it.

    Raises:
        OSError: it cannot be created (`FileExistsError`: something is there already, and is
            left as it is).
    """
    fd = os.open(path, _CREATE, mode)
    # A filesystem without locks (ENOLCK, EOPNOTSUPP) leaves the file to the grace alone;
    # LOCK_NB: nothing else can hold the lock of a file this new (clean-up waits GRACE_S).
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def remove_stale(path: str | os.PathLike[str], now: float | None = None) -> bool:
    """Delete the in-flight file at `path` if its writer is gone: a regular file, unchanged
    for `GRACE_S` before `now` (default: the time now), whose lock is free. Returns whether it
    was deleted; anything else there (a directory, a FIFO, a symlink, a file in flight, one
    that cannot be opened) is left, and nothing raises."""
    now = time.time() if now is None else now
    try:
        seen = os.lstat(path)
        if not stat.S_ISREG(seen.st_mode) or now - seen.st_mtime < GRACE_S:
            return False
        fd = os.open(path, _PEEK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its writer lives
        # Still the file judged above (not renamed away and replaced meanwhile)?
        if not (os.path.samestat(seen, os.fstat(fd)) and os.path.samestat(seen, os.lstat(path))):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
