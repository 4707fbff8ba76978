"""Trace replays: production request traces (block-hash chains) through kvtier's own storage
manager and tiers, beside the LRU and Belady bounds computed from the same file.

    trace.py   reading a trace (one JSON request a line) into requests of 512-token blocks
    bounds.py  the plain-Python caches: infinite, leaf-first LRU, Belady's offline optimum
    predicted.py  an experiment: eviction by each block's predicted next use (issue 69)
    replay.py  the replay through kvtier's StorageManager, its table and its JSON
    plot.py    hit rate against capacity per policy, from replay.py's JSON (docs/policies.png)
"""
