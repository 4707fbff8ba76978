"""The path keys of the config (`local_disk`): how a value names a directory, as LMCache reads
it, and the absolute path `Config` keeps instead.

LMCache (`lmcache/v1/config_base.py`, `_parse_local_disk`) removes a leading `file://` and
takes the rest verbatim as the directory, which `LocalDiskBackend` passes to `os.makedirs`:
`file:///abs/` is `/abs/`, and `file://local_disk/` (its own examples' spelling) is the
relative `local_disk/`, under the working directory. There is no host part: LMCache reads
`file://localhost/x` and `file://otherhost/x` as the relative paths `localhost/x` and
`otherhost/x` and refuses neither, so kvtier reads them the same way (never as RFC 8089 hosts)
and says where the directory is. What LMCache could not use either stays an error here: an
empty path, another scheme, a NUL byte, several disks (kvtier keeps one directory).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvtier.errors import ConfigError

__all__ = ["PATH_KEYS", "check_local_disk", "disk_path", "resolved_paths"]

logger = logging.getLogger(__name__)

PATH_KEYS = ("local_disk",)  # keys holding a filesystem path, resolved by `resolved_paths`
FILE = "file://"
MAX_PATH = 1024


def disk_path(value: str) -> str:
    """The directory `local_disk` names, as LMCache reads it: `value` without surrounding
    whitespace and without a leading `file://` (`file:///a/` is `/a/`, `file://a/` is the
    relative `a/`)."""
    return value.strip().removeprefix(FILE).strip()


def _shown(value: str) -> str:
    return repr(value if len(value) <= 200 else value[:200] + "...")


def local_disk_problem(value: str) -> str | None:
    """Why `value` cannot name the disk tier's directory, or None."""
    parts = [p.strip() for p in value.split(",")]
    if len(parts) > 1 and all(p.startswith((FILE, "/", "~")) for p in parts[1:]):
        return (f"several disks ({_shown(value)}) are not supported: kvtier keeps one "
                "directory (pick one, or put the disks behind one mount)")
    path = disk_path(value)
    if not path or value.strip().startswith(("redis", "http")) or "://" in path:
        return f"must be a directory path or file:///path URL, got {_shown(value)}"
    if "\0" in path:
        return f"holds a NUL byte: {_shown(value)}"
    if len(path) > MAX_PATH:
        return f"is {len(path)} characters long; at most {MAX_PATH}"
    return None


def check_local_disk(value: str) -> None:
    """`ConfigError` naming `local_disk` and `value` when it cannot name a directory
    (`local_disk_problem`)."""
    problem = local_disk_problem(value)
    if problem is not None:
        raise ConfigError(f"config: local_disk: {problem}")


def _expand_home(key: str, value: str, path: str) -> str:
    expanded = os.path.expanduser(path)
    own_home = path == "~" or path.startswith("~/")
    if expanded.startswith("~") or (own_home and os.environ.get("HOME") == ""):
        raise ConfigError(f"config: {key}: cannot expand '~' in {value!r} (no home "
                          "directory for that user): give an absolute path")
    return expanded


def resolved_paths(cfg: Any) -> dict[str, str]:
    """The path keys of `cfg` (`PATH_KEYS`) whose value `Config` must store otherwise: a
    leading `~` expanded (`os.path.expanduser`), a relative path made absolute against the
    working directory now (so the tier stays where it was resolved, whatever the process does
    with its working directory later); a `file://` prefix is kept. Values with a problem
    (`local_disk_problem`) are left for the checks to refuse as written.

    Logs one warning per relative value, naming the absolute path it resolved to: a relative
    path (LMCache's `file://local_disk/`) depends on where the server was started.

    Raises:
        ConfigError: naming the key when `~` cannot be expanded (no such user, or `HOME`
            empty: left as it is, the path would create a directory literally named `~`), or
            when a relative path meets a working directory that cannot be read (deleted).
    """
    out = {}
    for key in PATH_KEYS:
        value = getattr(cfg, key)
        if not isinstance(value, str) or local_disk_problem(value) is not None:
            continue
        path = disk_path(value)
        if path.startswith("~"):
            path = _expand_home(key, value, path)
        elif not os.path.isabs(path):
            try:
                path = os.path.abspath(path)
            except OSError as exc:  # the working directory was deleted
                raise ConfigError(f"config: {key}: {value!r} is relative and the working "
                                  f"directory cannot be read ({exc.strerror or exc}): give an "
                                  "absolute path") from None
            spelt = (f"{value!r}, the relative path {disk_path(value)!r} as LMCache reads it,"
                     if value.strip().startswith(FILE) else f"{value!r}, a relative path,")
            logger.warning("kvtier config: %s: %s puts the disk tier in %s (under the working "
                           "directory; write that absolute path to keep it there wherever the "
                           "server starts)", key, spelt, path)
        else:
            continue
        out[key] = (FILE if value.strip().startswith(FILE) else "") + path
    return out
