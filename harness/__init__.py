"""Real processes for tests and benchmarks (not shipped): redis-server and Redis Clusters on
free loopback ports (`redis`), SGLang servers with and without kvtier (`sglang_server`, with
the test plugin in `sglang_pythonpath/`), and a loopback proxy that delays, throttles or cuts
a connection (`delay_proxy`). Everything started here is stopped by the pid it was started
with. The pytest fixtures that use them are in tests/conftest.py and its neighbours."""
