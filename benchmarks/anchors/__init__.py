"""The anchor benchmarks (`make anchors`): the methods SGLang HiCache and LMCache publish, as
kvtier's own code, on real SGLang servers with and without kvtier.

    bench_multiturn.py  SGLang HiCache's multi-turn method (entry point)
    bench_longdoc.py    LMCache's long-document QA method and an all-miss run (entry point)
    cli.py              the command-line pieces both share
    client.py           the HTTP client: streaming `/generate` and `/flush_cache`
    documents.py        the long-document QA workload
    driver.py           the load driver: clients, rounds, arrivals, in-flight bound
    report.py           rows per arm and group, ratios to `none`, table, JSON and plot
    servers.py          the arms: the servers with and without kvtier, and the Redis
    stats.py            TTFT statistics, throughput, hit rate, output identity
"""
