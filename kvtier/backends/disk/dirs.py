"""The disk tier's directories and their privacy: which may hold records, and how they are made.

The tree holds every user's prompts, so kvtier makes its directories 0700 (records 0600) and
uses a directory only once it is checked to be a real directory of this user that nobody else
can write to (`dir_problem`): the root when the tier opens (`prepare_root`, which also refuses
a symlink anywhere in its path), each `ab/cd` directory on first use (`RecordDirs`). Naming,
writing, reading and scanning the records in them is kvtier.backends.disk.files, which
re-exports every public name here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from kvtier.backends.disk.paths import root_problem

__all__ = ["DIR_MODE", "FILE_MODE", "RecordDirs", "UnsafeDirectory", "dir_problem",
           "prepare_root"]


# O_EXCL: never an existing file, nor a symlink (even a dangling one) at the temp name.
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
DIR_MODE = 0o700  # only the owner may list, enter or change the tree ...
FILE_MODE = 0o600  # ... or read a record (an older tree's 0755/0644 is left as it is)


class UnsafeDirectory(OSError):
    """A directory of the tree is not private to this user, or could redirect it (a symlink);
    `strerror` says what is wrong and, for a root, how to fix it."""


def dir_problem(st: os.stat_result) -> str | None:
    """Why a directory with `os.lstat` result `st` must not hold records, or None if it may:
    a real directory of this process's user that nobody else can write to."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by uid {os.geteuid()} that runs kvtier"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _walk_root(root: Path) -> os.stat_result:
    """Create the missing components of the absolute path `root` (0700) and return its
    `lstat`. A symlink in any component is refused, since whoever can change it could redirect
    the tree; pre-existing parents (such as /tmp) are otherwise not ours to judge."""
    current = Path(root.anchor)
    st = os.lstat(current)
    for part in root.parts[1:]:
        current /= part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # made meanwhile by another process
                os.mkdir(current, DIR_MODE)
            st = os.lstat(current)
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeDirectory(errno.EPERM, (
                f"{root} goes through the symlink {current} -> {os.readlink(current)}, which "
                f"could redirect every user's cached prompts; kvtier refuses symlinks in this "
                f"path: set local_disk to the real path {os.path.realpath(root)}"))
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(current))
    return st


def prepare_root(root: Path) -> str | None:
    """Create the absolute path `root` if needed (0700), check it is private, and write a
    probe file in it. Never changes the mode of an existing directory.

    Returns a warning to log when group or others can read or enter the root, else None.

    Raises:
        UnsafeDirectory: a component is a symlink, or the root is another user's or writable
            by others (`strerror` says how to fix it).
        OSError: a component is not a directory, cannot be created, or the root not written.
    """
    why = root_problem(root)
    if why is not None:  # checked before anything is created
        raise UnsafeDirectory(errno.EPERM, f"{root} {why}: the disk tier makes its directories "
                                           "and deletes records there; use a directory of its own")
    st = _walk_root(root)
    why = dir_problem(st)
    if why is not None:
        fix = (f"`chmod go-w {root}` (700 is best)" if st.st_uid == os.geteuid()
               else f"`chown {os.geteuid()} {root}` or use a directory of uid {os.geteuid()}")
        raise UnsafeDirectory(errno.EPERM, f"{root} {why}; the cache holds every user's "
                                           f"prompts, so its directory must be private: {fix}")
    # A name of its own, never this pid's: a server with this pid in another PID namespace
    # may be checking the same root, and nothing another process made is ever unlinked.
    probe = root / f".probe.{secrets.token_hex(8)}.tmp"
    os.close(os.open(probe, _WRITE_FLAGS, FILE_MODE))
    os.unlink(probe)
    if st.st_mode & 0o055:
        return (f"{root} can be read or entered by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):o}), who may then read cached prompts; `chmod 700 "
                f"{root}` makes it private (kvtier leaves the mode of an existing directory)")
    return None


class RecordDirs:
    """Which `ab/cd` directories under `root` are checked to be private (see `dir_problem`).

    A directory is checked once per process, on first use (an `lstat` of the root, `ab` and
    `ab/cd`), then trusted: with the root and it private, only this user (or the superuser)
    can replace it afterwards. Thread-safe: a race only repeats a check.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._ok = bytearray(1 << 16)  # one flag per `ab/cd`, at int("abcd", 16)

    def mark(self, name: str) -> None:
        """Trust the directory of record `name` (the caller checked it)."""
        self._ok[int(name[:4], 16)] = 1

    def problem(self, name: str) -> str | None:
        """What is wrong with the directories of record `name`, or None if they are private or
        missing (nothing there to redirect: the caller's open fails). Creates nothing."""
        if self._ok[int(name[:4], 16)]:
            return None
        return self._check(name, create=False)

    def require(self, name: str, recheck: bool = False) -> None:
        """Make sure the directories of record `name` exist (created 0700) and are private;
        `recheck`: the tree was removed behind our back, so every earlier check is forgotten
        (whatever stands there now is checked anew, the root included).

        Raises:
            UnsafeDirectory: one is a symlink, another user's or writable by others.
            OSError: one cannot be created.
        """
        if recheck:
            self._ok = bytearray(1 << 16)  # rebinding is atomic: a racing mark is just lost
        if not self._ok[int(name[:4], 16)]:
            why = self._check(name, create=True)
            if why is not None:
                raise UnsafeDirectory(errno.EPERM, why)

    def _check(self, name: str, create: bool) -> str | None:
        top = self.root / name[:2]
        for path in (self.root, top, top / name[2:4]):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                if not create:
                    return None
                with contextlib.suppress(FileExistsError):  # made meanwhile by another writer
                    os.mkdir(path, DIR_MODE)
                st = os.lstat(path)
            why = dir_problem(st)
            if why is not None:
                return f"{path} {why}"
        self.mark(name)
        return None
