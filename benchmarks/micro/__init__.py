"""Component benchmarks: no SGLang server, one piece of kvtier against a baseline measured in
the same run.

    bench_connectors.py the CPU gather/scatter kernels vs memcpy and torch
    bench_disk.py       the disk tier's put/get vs raw file I/O
    bench_redis.py      the Redis tier's put/get vs redis-py and a raw-socket client
    bench_gpu.py        engine store/retrieve on CUDA pools vs a pinned memcpy (needs a GPU)
    bench_retrieve.py   a cold retrieve from the disk tier, pipelined vs serial
    bench_admission.py  the admission copy from the CPU tier into the KV pool, batched vs per chunk
    bench_policies.py   the CPU tier's store and lookup under each eviction/admission policy vs lru
    bench_sealing.py    record sealing (AES-GCM) per tenant key vs the record key alone
    bench_codec.py      the lower tiers' codecs (remote_serde): fp8 vs naive, codec vs memcpy
    bench_codec_writes.py  fp8 vs naive disk writers and loads per chunk, quiet and busy
"""
