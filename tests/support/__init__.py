"""Process helpers shared by the tests and the benchmarks (never part of the package):
`redis` (real redis-server processes) and `sglang_server` (real CPU SGLang servers, with the
test plugin in `sglang_pythonpath/`). The pytest fixtures that use them are in the conftest.py
files."""
