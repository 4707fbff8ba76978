"""What the disk tier would refuse in a config, found before it is opened (a server's launch,
an HTTP attach): its root (the filesystem root, a system or home directory, a symlink on the
way), as the tier checks when it opens; then whether `max_local_disk_size` fits the filesystem
(`kvtier.config.host.disk_problem`). The tier's row names it (`TierSpec.check`)."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.backends.disk import paths
from kvtier.config import Config
from kvtier.config.host import disk_problem

__all__ = ["disk_tier_problem"]


def disk_tier_problem(config: Config) -> str | None:
    """The first thing the disk tier would refuse in `config`, or None (no disk tier, or all
    fits). A refused root is not walked for the size it holds."""
    if config.local_disk_path is None:
        return None
    root = os.path.abspath(config.local_disk_path)
    why = paths.root_problem(root)
    link = paths.first_symlink(Path(root))
    if why is None and link is not None:
        why = f"goes through the symlink {link}"
    if why is not None:
        return f"local_disk: {root} {why}; the disk tier refuses it"
    return disk_problem(config)
