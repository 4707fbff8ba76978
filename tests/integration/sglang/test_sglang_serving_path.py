"""The serving path of a fresh kvtier server (real SGLang on CPU): the copy kernel is built
before the server takes requests, never on a serving thread; `/flush_cache` succeeds at the
first call after a request; a queued request's prefix is loaded once, when it is admitted; every
kvtier call on the scheduler thread is timed."""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.sglang_server import SGLangServer
from tests.integration.sglang.conftest import CHUNK, cold, prompt, write_config

# A fresh server as users launch it: its children spawned, each loading kvtier's plugin and
# kernels itself.
pytestmark = [pytest.mark.sglang, pytest.mark.spawn]

COMPILED = re.compile(r"kvtier: compiled the C\+\+ copy kernel in [\d.]+s on thread (\S+)")
# The HTTP server's start: no request is taken before it. (SGLang's "fired up and ready" line
# comes after /model_info already answers, so a log read once the server answers may lack it.)
SERVING = "Uvicorn running on"


@pytest.fixture(scope="module")
def fresh(start_server: Callable[..., SGLangServer], tiny_llama: Path,
          tmp_path_factory: pytest.TempPathFactory) -> SGLangServer:
    """A kvtier server on a host that has never built the kernel (empty KVTIER_CACHE_DIR),
    with a pool that holds about one 1200-token prompt next to a running request. Its metrics
    are read on SGLang's own port (`--enable-metrics`): a `metrics_port` picked free before
    the start was taken by another process during the kernel's compile in a CI run (kvtier
    warned and served none; the test read the other process's port)."""
    work = tmp_path_factory.mktemp("fresh")
    config = write_config(work / "kvtier.yaml")
    return start_server(tiny_llama, config, "--max-total-tokens", "2048", "--enable-metrics",
                        env={"KVTIER_CACHE_DIR": str(work / "empty-cache")})


def _generate(server: SGLangServer, ids: list[int], rid: str, max_new: int = 8) -> list[int]:
    out = server.post("/generate", {
        "input_ids": ids, "rid": rid,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True},
    })
    return list(out["output_ids"])


def _sample(server: SGLangServer, name: str, **labels: str) -> float:
    """kvtier's sample `name` with `labels` on the server's /metrics, summed over processes."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = [s.value for family in text_string_to_metric_families(text)
             for s in family.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, f"{name} {labels} not exported"
    return sum(found)


def test_kernel_is_built_before_serving_and_flush_works_at_once(
        fresh: SGLangServer) -> None:
    server = fresh
    log = server.log()
    builds = COMPILED.findall(log)
    assert len(builds) == 1, builds  # the empty cache made this server compile, once
    assert not builds[0].startswith("kvtier-"), builds  # not a store/prefetch/writer thread
    assert log.index("compiled the C++ copy kernel") < log.index(SERVING)

    ids = prompt(31, 5 * CHUNK)
    _generate(server, ids, "first")
    server.flush_cache()  # one call, no retry (SGLang waits for idle): an HTTPError fails
    assert len(COMPILED.findall(server.log())) == 1  # no copy compiled anything later


def test_queued_request_is_loaded_once_at_admission(fresh: SGLangServer) -> None:
    server = fresh
    long_ids = prompt(32, 1200)
    expected = cold(server, long_ids)
    assert _generate(server, long_ids, "store-it") == expected
    server.flush_cache()

    # A running request takes most of the pool while the stored prompt comes back: the
    # scheduler matches the waiting request on every admission attempt, but kvtier copies its
    # prefix only when it is admitted.
    streaming = threading.Event()
    runner = threading.Thread(target=server.stream_generate, args=(prompt(33, 900), 400),
                              kwargs={"on_chunk": streaming.set})
    runner.start()
    assert streaming.wait(120)
    got = _generate(server, long_ids, "queued")
    runner.join()
    assert got == expected
    loads = re.findall(r"kvtier: loaded (\d+) tokens at admission of queued\b", server.log())
    assert loads == [str(len(long_ids) - 1)]  # all but the last token (SGLang computes it)
    assert _sample(server, "kvtier_sglang_loads_discarded_total") == 0
    for call in ("match_prefix", "init_load_back", "checkpoint"):
        assert _sample(server, "kvtier_scheduler_seconds_count", call=call) >= 1
