"""The disk tier: `backend` (the tier: index, eviction, reads and writes), `index` (what is
where, what to evict), `files` (the record files, their layout and their privacy), `paths`
(which roots it may use, which files under one are its own)."""

from __future__ import annotations

from kvtier.backends.disk.backend import DiskBackend

__all__ = ["DiskBackend"]
