"""The disk tier's start-up probe: a scratch file beside the records, timed and removed.

It lives in the root, not in an `ab/cd` directory, so the scan and the index never see it;
its name carries the writer's pid, so one left by a killed process is removed by the next
probe of any process sharing the directory.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import time
from pathlib import Path

from kvtier.backends.base import PROBE_PREFIX, ProbeSample

__all__ = ["probe_disk", "scratch_files"]

_SEQ = itertools.count()
_NAME = re.compile(rf"\.{PROBE_PREFIX}\.(\d+)\.\d+\.tmp")
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_WRITE_STEP = 1 << 20


def scratch_files(root: Path) -> list[Path]:
    """The probe files now in `root` (a test's view: none once every probe has ended)."""
    return [root / n for n in os.listdir(root) if _NAME.fullmatch(n)]


def probe_disk(root: Path, nbytes: int) -> ProbeSample:
    """Write `nbytes` to a scratch file in `root`, time a lookup (an `lstat`, as a record
    lookup that misses the index) and a read of it, and delete it whatever happens."""
    _remove_orphans(root)
    path = root / f".{PROBE_PREFIX}.{os.getpid()}.{next(_SEQ)}.tmp"
    try:
        start = time.perf_counter()
        with contextlib.suppress(FileNotFoundError):
            os.lstat(path)
        round_trip = time.perf_counter() - start
        fd = os.open(path, _FLAGS, 0o600)
        try:
            block = bytes(min(nbytes, _WRITE_STEP))
            for offset in range(0, nbytes, _WRITE_STEP):
                os.pwrite(fd, block[: nbytes - offset], offset)
        finally:
            os.close(fd)
        buf = bytearray(nbytes)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(buf) or 0
        return ProbeSample(round_trip, got, time.perf_counter() - start)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _remove_orphans(root: Path) -> None:
    """Delete probe files whose process is gone (killed half-way through its probe)."""
    for path in scratch_files(root):
        match = _NAME.fullmatch(path.name)
        if match is not None and not _alive(int(match[1])):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
