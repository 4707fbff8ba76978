"""Prefetch: lower-tier chunks move into the CPU tier ahead of the request that needs them.

    handle.py         Prefetch: one request's load, polled by the serving thread
    workers.py        Prefetcher: worker threads that run loads in turns, window by window
    loads.py          PrefetchLoads: starting loads, each turn's work, sharing chunks in flight
    policy.py         the policies as classes: how long a request waits, how much loads
    planner.py        LoadPlanner: load or recompute, from measured speeds (`adaptive`)
    estimates.py      measured tier and prefill speeds
    prefill_prior.py  the prefill speed to assume before one is measured, from the model's shape

A new policy is one `PrefetchPolicy` subclass in policy.py and its name in
`kvtier.config.names.PREFETCH_POLICIES`. Nothing is imported here, so that a tier's guard can
take `estimates` without pulling in the loads that use it.
"""
