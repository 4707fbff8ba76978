"""The storage manager and its parts: what moves chunks between the tiers.

    manager.py    StorageManager: the hot tier and the lower tiers behind one batched,
                  prefix-aware interface (put, get, stream, contains, start_prefetch, attach)
    guard.py      the failure rule around every tier: a failing call is a counted miss; timings
    write_policy.py  write policies: when a put reaches the lower tiers
    writer.py     one background writer per lower tier
    tierset.py    the live set of lower tiers and their writers: attach/detach while stores
                  and loads run, flush
    prefetch/     loads from the lower tiers ahead of the request: its handle and workers,
                  the policies (classes), the planner and the speeds it plans from
    sessions.py   session pins in the CPU tier
"""

from __future__ import annotations

from kvtier.storage.manager import StorageManager

__all__ = ["StorageManager"]
