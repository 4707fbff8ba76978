"""The disk tier: `backend` (the tier: index, eviction, reads and writes), `index` (what is
where, what to evict), `files` (the record files, their layout and their privacy)."""

from __future__ import annotations

from kvtier.backends.disk.backend import DiskBackend

__all__ = ["DiskBackend"]
