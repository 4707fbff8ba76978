"""Benchmarks of servers as an operator runs them: a fleet on one Redis Cluster, tiers
attached at run time.

    bench_fleet.py      N servers behind SMG on one Redis Cluster (`make fleet`)
    runs.py             bench_fleet's runs: the cluster, the servers, the gateway, the failover
    gateway.py          SMG (or the legacy sglang-router) as a process; SGLang as gRPC workers
    bench_tier_routing.py  multi-turn behind SMG: round robin, the tree, KV events (entry point)
    report.py           bench_fleet's table, failover line, JSON and plot
    shared.py           bench_fleet's options and what a run measured
    bench_attach.py     a running stream's gaps while an admin attaches a Redis tier (entry point)
"""
