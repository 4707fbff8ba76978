"""The disk tier's start-up probe: a scratch file beside the records, timed and removed.

It lives in the root, not in an `ab/cd` directory, so the scan and the index never see it.
Its name is random (`.kvtier-probe.<hex>.tmp`), so no other process, in this PID namespace or
another, picks it; it is locked while in flight (`inflight`), so one left by a killed process
is removed by a later probe of any process sharing the directory, and one in flight is not.
A probe unlinks only the file it created.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from pathlib import Path

from kvtier.backends.base import PROBE_PREFIX, ProbeSample
from kvtier.backends.disk import inflight

__all__ = ["probe_disk", "scratch_files"]

# Any probe file: this version's random names, and earlier ones' `<pid>.<seq>`.
_NAME = re.compile(rf"\.{PROBE_PREFIX}\.[0-9a-f.]+\.tmp")
_WRITE_STEP = 1 << 20


def scratch_files(root: Path) -> list[Path]:
    """The probe files now in `root` (a test's view: none once every probe has ended)."""
    return [root / n for n in os.listdir(root) if _NAME.fullmatch(n)]


def probe_disk(root: Path, nbytes: int) -> ProbeSample:
    """Write `nbytes` to a scratch file in `root`, time a lookup (an `lstat`, as a record
    lookup that misses the index) and a read of it, and delete it whatever happens.

    Raises:
        OSError: a step failed (`FileExistsError`: something is at the scratch name, left
            as it is).
    """
    for path in scratch_files(root):  # left by killed processes
        inflight.remove_stale(path)
    path = root / f".{PROBE_PREFIX}.{secrets.token_hex(8)}.tmp"
    start = time.perf_counter()
    with contextlib.suppress(FileNotFoundError):
        os.lstat(path)
    round_trip = time.perf_counter() - start
    fd = inflight.create_locked(path)
    try:
        block = bytes(min(nbytes, _WRITE_STEP))
        for offset in range(0, nbytes, _WRITE_STEP):
            os.pwrite(fd, block[: nbytes - offset], offset)
        buf = bytearray(nbytes)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(buf) or 0
        return ProbeSample(round_trip, got, time.perf_counter() - start)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)  # after the unlink: in flight until it is gone
