"""Which paths the disk tier may use and what under them is its own (issue 36, item 7).

- A root is never the filesystem root, a home directory or a directory above one, nor a system
  directory (`root_problem`): the tier creates its fan-out there and evicts, and `kvtier purge`
  deletes, in it. A path through a symlink is refused too (`first_symlink`; the tier's own
  open refuses it in `files.prepare_root`).
- Only files named as the tier names them are its own: records `ab/cd/<64 hex>.kvt` whose
  name starts with `abcd`, and temp files `<64 hex>.<pid>.<seq>.tmp` beside them. Anything
  else under a root is never indexed, evicted or deleted (`record_stem`, `is_temp_name`).
- `unlink_record` deletes a record without following a symlink anywhere below the root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from pathlib import Path

__all__ = ["root_problem", "first_symlink", "record_stem", "is_temp_name", "unlink_record",
           "SYSTEM_DIRS"]

SUFFIX = ".kvt"
_HEX = frozenset("0123456789abcdef")
# Directories whose contents belong to the system (Linux and macOS): never a tier's root.
SYSTEM_DIRS = frozenset({
    "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media",
    "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr",
    "/usr/local", "/var", "/var/cache", "/var/lib", "/var/tmp", "/Applications", "/Library",
    "/System", "/Users", "/Volumes", "/private", "/private/tmp", "/private/var",
})
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _homes() -> set[str]:
    """This user's home directories: `$HOME` and the password database's."""
    found = {os.path.expanduser("~")}
    with contextlib.suppress(KeyError):
        found.add(pwd.getpwuid(os.geteuid()).pw_dir)
    return {os.path.normpath(h) for h in found if h and os.path.isabs(h)}


def root_problem(root: str | os.PathLike[str]) -> str | None:
    """Why the absolute path `root` must not be a disk tier's root, or None: the filesystem
    root, a system directory, this user's home directory or a directory above it (the same
    directory spelled otherwise, a bind mount, counts)."""
    norm = os.path.normpath(root)
    if Path(norm).parent == Path(norm):
        return "is the filesystem root"
    for home in sorted(_homes()):
        if norm == home or home.startswith(norm + os.sep):
            return f"is the home directory {home}" if norm == home else \
                f"holds the home directory {home}"
    if norm in SYSTEM_DIRS:
        return "is a system directory"
    with contextlib.suppress(OSError):
        st = os.stat(norm)
        for other in ("/", *sorted(_homes())):
            with contextlib.suppress(OSError):
                if os.path.samestat(st, os.stat(other)):
                    return f"is {other} (under another name)"
    return None


def first_symlink(root: Path) -> Path | None:
    """The first component of the absolute path `root` that is a symlink, or None (missing
    components are not looked at further)."""
    current = Path(root.anchor)
    for part in root.parts[1:]:
        current /= part
        try:
            if stat.S_ISLNK(os.lstat(current).st_mode):
                return current
        except OSError:
            return None
    return None


def _in_place(name: str, top: str, sub: str) -> bool:
    return len(name) == 64 and set(name) <= _HEX and name[:2] == top and name[2:4] == sub


def record_stem(filename: str, top: str, sub: str) -> str | None:
    """The record name of file `filename` in directory `top/sub` (two hex pairs) when it is
    named as a record there, else None."""
    stem = filename[: -len(SUFFIX)] if filename.endswith(SUFFIX) else ""
    return stem if _in_place(stem, top, sub) else None


def is_temp_name(filename: str, top: str, sub: str) -> bool:
    """Whether `filename` in `top/sub` is named as the tier's temp files are."""
    parts = filename.split(".")  # <stem>.<pid>.<seq>.tmp, ASCII digits only (str.isdigit
    # takes "²"): the numbers are never read, but a name is ours only as the tier writes it
    return (len(parts) == 4 and parts[3] == "tmp" and _digits(parts[1]) and _digits(parts[2])
            and _in_place(parts[0], top, sub))


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def unlink_record(root: Path, filename: str) -> bool:
    """Delete record file `filename` (`<64 hex>.kvt`) under `root` at `ab/cd/`, opening each
    directory with O_NOFOLLOW and deleting only a regular file; False when it is not there,
    not a record name, or not a regular file."""
    stem = filename[: -len(SUFFIX)] if filename.endswith(SUFFIX) else ""
    if record_stem(filename, stem[:2], stem[2:4]) is None:
        return False
    fds: list[int] = []
    try:
        fds.append(os.open(root, _DIR_FLAGS))
        for part in (stem[:2], stem[2:4]):
            fds.append(os.open(part, _DIR_FLAGS, dir_fd=fds[-1]))
        if not stat.S_ISREG(os.lstat(filename, dir_fd=fds[-1]).st_mode):
            return False
        os.unlink(filename, dir_fd=fds[-1])
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            return False
        raise
    finally:
        for fd in fds:
            os.close(fd)
