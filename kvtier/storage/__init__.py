"""The storage manager and its parts: what moves chunks between the tiers.

    manager.py    StorageManager: the hot tier and the lower tiers behind one batched,
                  prefix-aware interface (put, get, stream, contains, start_prefetch, attach)
    guard.py      the failure rule around every tier: a failing call is a counted miss; timings
    write_policy.py  write policies: when a put reaches the lower tiers
    writer.py     one background writer per lower tier
    tierset.py    the live set of lower tiers and their writers: attach/detach while stores
                  and loads run, flush
    prefetch.py   a prefetch's handle; the workers that run loads round-robin
    loads.py      PrefetchLoads: the loads in flight, shared by reference
    prefetch_policy.py  when a waiting request may go on
    planner.py    LoadPlanner: load or recompute, how much of a hit a prefetch loads
    estimates.py  measured tier and prefill speeds
    sessions.py   session pins in the CPU tier
"""

from __future__ import annotations

from kvtier.storage.manager import StorageManager

__all__ = ["StorageManager"]
