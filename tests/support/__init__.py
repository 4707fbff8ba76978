"""Helpers only the tests use: `metric_docs` (docs/metrics.md read as the metrics it
documents), `no_sglang` (collection with SGLang blocked). Processes the tests and the
benchmarks share (Redis, SGLang servers, the delay proxy) are in `harness/`."""
