"""The kernels wing: kvtier's compiled copies and everything about them.

`ops` (gather/scatter between a paged pool and chunk memory, and two one-pass helpers of the
compiled module: a slot tensor's bounds and token ids as key bytes; the entry point, which
re-exports the two below), `extension` (loading and choosing the compiled module), `reference`
(the PyTorch copies the kernels are tested against), `tokens` (token ids as the
bytes chunk keys hash: through `ops.token_bytes`, else numpy), `checks` (the copies' argument
checks), `build` (the C++/CUDA build, once per recipe, before serving), `host_copy` (the CUDA
copy between a pool and pinned host chunks or a staging buffer), and the sources in `csrc/`.
The connectors (pool views, staging, huge pages, and the CUDA streams that order a pool's
copies: `kvtier.connectors.streams`) call in here; nothing here imports a connector.
"""
