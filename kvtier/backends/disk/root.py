"""Opening the disk tier's root: created or checked (private, no symlink, not a system
directory), and its records listed for the index."""

from __future__ import annotations

import logging
from pathlib import Path

from kvtier.backends.disk import files as rf
from kvtier.errors import ConfigError

__all__ = ["open_root"]

logger = logging.getLogger("kvtier.backends.disk.backend")


def open_root(root: Path, given: Path, dirs: rf.RecordDirs,
              ) -> tuple[list[tuple[int, str, int]], int]:
    """Create or check the disk tier's root (`files.prepare_root`) and list its records:
    `(mtime_ns, name, size)` oldest first, and how many stale temporary files were removed.
    `ConfigError` naming `local_disk` (as `given`) if it cannot be used or is not private."""
    try:
        note = rf.prepare_root(root)
        found, stale = rf.scan(root, dirs)
    except rf.UnsafeDirectory as exc:  # says what is wrong and how to fix it
        raise ConfigError(f"local_disk: {exc.strerror}") from None
    except OSError as exc:
        raise ConfigError(f"local_disk: cannot use {given}: {exc.strerror}") from None
    if note is not None:
        logger.warning("kvtier disk: %s", note)
    return found, stale
