"""The kernels wing: kvtier's compiled copies and everything about them.

`ops` (gather/scatter between a paged pool and chunk memory, the token hash), `tokens` (token
ids as the bytes chunk keys hash), `checks` (their argument checks), `build` (the C++/CUDA
build, once per recipe, before serving), `host_copy` (the CUDA copy between a pool and pinned
host memory), and the sources in `csrc/`. The connectors (pool views, staging, huge pages, and
the CUDA streams that order a pool's copies: `kvtier.connectors.streams`) call in here;
nothing here imports a connector.
"""
