"""Whose records a shared disk directory holds: each record's owner is its key's namespace and
model. Learned for free as records are written and read; for the records found at start, from
their headers, read on a background thread at a bounded rate, so opening a directory of a
million records costs nothing up front and never evicts what it has not identified."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from kvtier.backends.disk import files as rf
from kvtier.backends.disk.index import TENANT_SEP
from kvtier.backends.record import FIXED_SIZE, header_len, read_key
from kvtier.background import name_os_thread
from kvtier.errors import CorruptEntry
from kvtier.keys import KeySpace, tag_of_key

__all__ = ["owner_of", "learn_in_background", "read_record_key", "identify"]

logger = logging.getLogger(__name__)

BATCH = 256  # headers read between pauses
PAUSE_S = 0.01  # at most ~25k headers a second: the disk serves reads and writes meanwhile


def read_record_key(dirs: rf.RecordDirs, name: str) -> str | None:
    """The key string in record `name`'s header (checksummed), read as `open_record` opens
    (its `NotRegular` and `OSError` propagate); None when the header is corrupt."""
    fd, _ = rf.open_record(dirs, name)
    try:
        prefix = os.pread(fd, FIXED_SIZE, 0)
        head = prefix + os.pread(fd, max(0, header_len(prefix) - FIXED_SIZE), FIXED_SIZE)
        return read_key(head)
    except (OSError, CorruptEntry):
        return None
    finally:
        os.close(fd)


def owner_of(key: str) -> str | None:
    """`namespace/model` of a kvtier key string, then `TENANT_SEP` and its tenant's tag for
    a salted key (the index's share per tenant); None for anything else."""
    parsed = KeySpace.parse(key)
    if parsed is None:
        return None
    tag = tag_of_key(key)
    owner = f"{parsed[0].namespace}/{parsed[0].model}"
    return owner if tag is None else f"{owner}{TENANT_SEP}{tag}"


def identify(dirs: rf.RecordDirs, name: str) -> str | None:
    """The owner of record `name`, read from its header; None when it cannot be told (gone,
    not a record of ours, corrupt): such a record is never evicted."""
    try:
        key = read_record_key(dirs, name)
    except OSError:
        return None
    return owner_of(key) if key else None


def learn_in_background(dirs: rf.RecordDirs, names: list[str],
                        learned: Callable[[str, str], None], lock: threading.Lock,
                        closed: threading.Event) -> threading.Thread:
    """Read the owner of each record in `names` and report it through `learned(name, owner)`
    (called under `lock`), `BATCH` at a time, until done or `closed` is set."""
    def run() -> None:
        name_os_thread()
        start, found = time.monotonic(), 0
        for i, name in enumerate(names):
            if closed.is_set():
                return
            owner = identify(dirs, name)
            if owner is not None:
                with lock:
                    learned(name, owner)
                found += 1
            if i % BATCH == BATCH - 1:
                time.sleep(PAUSE_S)
        logger.info("kvtier disk: owners of %d of %d records found at start identified in "
                    "%.1fs", found, len(names), time.monotonic() - start)

    thread = threading.Thread(target=run, name="kvtier-disk-owners", daemon=True)
    thread.start()
    return thread
