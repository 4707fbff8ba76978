"""The kernels wing: kvtier's compiled copies and everything about them.

`ops` (gather/scatter between a paged pool and chunk memory, the token hash), `tokens` (token
ids as the bytes chunk keys hash), `checks` (their argument checks), `build` (the C++/CUDA
build, once per recipe, before serving), `host_copy` (the CUDA copy between a pool and pinned
host memory), `streams` (kvtier's CUDA streams and events, and the fence that releases a
load's objects), and the sources in `csrc/`. The connectors (pool views, staging, huge pages)
call in here; nothing here knows a connector but `streams`, which copies through one (its
staging and copy path): an import back up that belongs beside the connectors.
"""
