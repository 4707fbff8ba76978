"""Fixtures for the SGLang integration tests: tiny local models, kvtier configs, servers.

These tests need the CPU SGLang environment (`scripts/setup_sglang.sh`); without it they fail
at import, they never skip. Servers are started on free loopback ports and stopped by pid; a
server that does not come up prints its log.
"""

from __future__ import annotations

import os
import random
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.sglang_server import SHIMS_DIR, SGLangServer
from kvtier.demo.models import make_deepseek_mla, make_llama

# In-process tests import SGLang's pools the way a CPU server does: CPU engine mode, which
# imports the sgl_kernel stand-in in sglang_cpu/. (Set before any test module imports SGLang.)
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
if str(SHIMS_DIR) not in sys.path:
    sys.path.insert(0, str(SHIMS_DIR))

VOCAB = range(4, 430)  # ids every tiny tokenizer has (specials are 0-3)
CHUNK = 16


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(models_dir: Path) -> Path:
    return make_llama(models_dir / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_mla(models_dir: Path) -> Path:
    return make_deepseek_mla(models_dir / "tiny-mla")


@pytest.fixture(scope="session")
def sglang_parallel_context() -> None:
    """SGLang's runtime TP/PP layout for in-process pools (MLA pools read it): one rank."""
    from sglang.srt import runtime_context

    runtime_context.get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)


def kvtier_metrics(server: SGLangServer) -> dict[str, float]:
    """kvtier's samples on the server's own `/metrics` (`--enable-metrics`), summed over
    labels and processes."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvtier_"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def write_config(path: Path, **values: Any) -> Path:
    """A kvtier YAML config with a small chunk size and arena, plus `values`. Requests wait
    for their background loads (`wait_complete`), so which tokens hit is deterministic."""
    data = {"chunk_size": CHUNK, "max_local_cpu_size": 0.05,
            "prefetch_policy": "wait_complete", **values}
    path.write_text(yaml.safe_dump(data))
    return path


def prompt(seed: int, n: int = 80) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(VOCAB) for _ in range(n)]


def cold(server: SGLangServer, ids: Sequence[int], max_new_tokens: int = 8) -> list[int]:
    """Output ids computed from scratch: a fresh `extra_key` namespaces the request away from
    both SGLang's prefix tree and kvtier (which bypasses namespaced requests)."""
    out = server.post("/generate", {
        "input_ids": list(ids), "extra_key": uuid.uuid4().hex,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                            "ignore_eos": True},
    })
    assert out["meta_info"]["cached_tokens"] == 0
    return list(out["output_ids"])


def logged(server: SGLangServer, pattern: str, count: int, timeout: float = 60.0) -> list[Any]:
    """The first `count` matches of `pattern` in the server's log, once there are that many
    (the store thread logs after the reply was sent); fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout  # a bound on a hang, not a timing assertion
    while len(found := re.findall(pattern, server.log())) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} {pattern!r} logged"
        time.sleep(0.05)
    return found[:count]


_LIVE: list[SGLangServer] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and _LIVE:
        for server in _LIVE:
            report.sections.append((f"SGLang server log {server.log_path}",
                                    serving_log(server.log())))


def serving_log(text: str, lines: int = 150) -> str:
    """What a failed test's report shows of a server log: kvtier's start-up lines, then the
    last `lines` from when it began serving, each cut to 500 characters, without SGLang's
    harmless post-warmup `/freeze_gc` traceback (a failed start is printed whole by
    `SGLangServer.start`)."""
    start = text.find("Uvicorn running")
    start = 0 if start < 0 else text.rfind("\n", 0, start) + 1
    kept = [line[:500] for line in text[:start].splitlines() if "kvtier" in line]
    serving: list[str] = []
    skipping = False
    for line in text[start:].splitlines():
        if "post-warmup freeze_gc failed" in line:
            skipping = True
        elif skipping and line.startswith("["):  # the next timestamped line ends the traceback
            skipping = False
        if not skipping:
            serving.append(line[:500])
    kept += serving[-lines:]
    return "\n".join(kept)


@pytest.fixture(scope="module")
def start_server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest,
) -> Iterator[Callable[..., SGLangServer]]:
    """`start(model, config_path, *extra_args, env=, ready=True)` -> a running kvtier-enabled
    server (with `ready=False` launched only: the caller waits with `wait_ready`, so its start
    overlaps other work); every server started through it is killed when the module's tests
    are done. Its children are forked (`SGLangServer`), unless the module is marked
    `spawn`."""
    started: list[SGLangServer] = []
    logs = tmp_path_factory.mktemp("sglang-logs")
    fork_children = request.node.get_closest_marker("spawn") is None

    def start(model: Path, config: Path | None, *args: str,
              env: dict[str, str] | None = None, ready: bool = True) -> SGLangServer:
        flags = ["--enable-kvtier", "--kvtier-config-file", str(config)] if config else []
        server = SGLangServer(model, logs / f"server-{len(started)}.log",
                              args=[*flags, *args], env=env, fork_children=fork_children)
        started.append(server)
        _LIVE.append(server)
        server.launch()
        if ready:
            server.wait_ready()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.kill()
            _LIVE.remove(server)


PROMPT_LEN = 80  # five chunks; the last prompt token is never cached


def page_size(server: SGLangServer) -> int:
    args = server.args
    return int(args[args.index("--page-size") + 1]) if "--page-size" in args else 1


def full_hit(server: SGLangServer, prompt_len: int = PROMPT_LEN) -> int:
    """What kvtier loads of a prompt it stored: all but the last prompt token (SGLang always
    computes that one), in whole pages: the chunk holding it loads in part."""
    return (prompt_len - 1) // page_size(server) * page_size(server)


def check_reload_after_flush(server: SGLangServer, seed: int) -> None:
    """A prompt served, `/flush_cache`, served again: kvtier loads all of it but the last
    token (in whole pages) and the greedy output equals a cold run."""
    ids = prompt(seed, PROMPT_LEN)
    expected = cold(server, ids)
    first = server.generate(ids)
    assert first["output_ids"] == expected
    assert first["meta_info"]["cached_tokens"] == 0
    server.flush_cache()  # also waits for kvtier's background stores

    again = server.generate(ids)
    assert again["meta_info"]["cached_tokens"] == full_hit(server)
    assert again["output_ids"] == expected
    assert f"kvtier: loaded {full_hit(server)} tokens" in server.log()


def check_conversation(servers: Sequence[SGLangServer], seed: int, turns: int = 4, *,
                       planned: Sequence[SGLangServer] = (),
                       landed: Callable[[], None] | None = None) -> None:
    """A conversation of `turns` turns, each sent to the next of `servers` with every device
    cache flushed first: each turn hits all of the previous turn's prompt and answer but at
    most one page (kvtier's tails), and answers as a cold run does. A server in `planned`
    (the `adaptive` policy, started with `--enable-metrics`) may also leave out the tail, one
    chunk at most, and whatever its metrics say it chose to recompute as quicker than the
    load: on a busy host a short prompt can recompute sooner than Redis answers. `landed`
    returns once the previous turn's writes to a shared tier are there to be read: another
    server's write-through is asynchronous, and a busy host can still be writing it."""
    history = prompt(seed, 37)
    before = 0  # tokens the previous turn computed: its prompt and answer
    for turn in range(turns):
        server = servers[turn % len(servers)]
        expected = cold(server, history)
        for each in servers:
            each.flush_cache()  # kvtier must serve it; also lands the previous turn's stores
        if landed is not None:
            landed()
        chosen = _timed_recomputes(server) if server in planned else 0.0
        got = server.generate(history)
        assert got["output_ids"] == expected, f"turn {turn + 1}"
        cached = got["meta_info"]["cached_tokens"]
        missing = page_size(server)
        if server in planned:
            missing = CHUNK + int(_recomputed_since(server, chosen, before - cached - CHUNK))
        assert before - missing <= cached <= len(history) - 1, (
            turn + 1, cached, missing, server in planned and planner_counts(server),
            server.log()[-3000:])
        before = len(history) + len(expected)
        history = history + expected + prompt(seed * 100 + turn, 23)


def planner_counts(server: SGLangServer) -> dict[str, float]:
    """A short hit's clues on an `adaptive` server (`--enable-metrics`): the planner's counts,
    and the tiers' writes and failures."""
    return {k: v for k, v in kvtier_metrics(server).items()
            if any(word in k for word in ("adaptive", "write", "fail", "error", "down"))}


CHOSEN = ("slower_than_recompute", "deadline", "unmeasured")  # the planner's own choices


def planned_hit(server: SGLangServer, ids: list[int], reasons: Sequence[str] = CHOSEN,
                ) -> tuple[dict[str, Any], int]:
    """`server.generate(ids)` on an `adaptive` server (`--enable-metrics`), and the tokens its
    hit fell short of `full_hit` by that its planner did not count as recomputed by choice for
    one of `reasons` (0: a full hit, or every missing token chosen: on a busy host a short
    prompt of the tiny model recomputes sooner than a round trip to a tier answers)."""
    before = _timed_recomputes(server, reasons, started=False)  # maybe not exported yet: 0
    got = server.generate(ids)
    short = full_hit(server, len(ids)) - got["meta_info"]["cached_tokens"]
    if short <= 0:
        return got, 0
    return got, short - int(_recomputed_since(server, before, short, reasons))


def _recomputed_since(server: SGLangServer, before: float, short: int,
                      reasons: Sequence[str] = CHOSEN) -> float:
    """The tokens an `adaptive` server chose to recompute since it had counted `before`, read
    until they reach `short` (the tokens a hit fell short by): its exporter syncs once a
    second, so a choice just made may not show yet (a CI run read it too soon). A bound on
    waiting for the count, not a timing the test asserts."""
    deadline = time.monotonic() + 10
    while (done := _timed_recomputes(server, reasons) - before) < short and \
            time.monotonic() < deadline:
        time.sleep(0.25)
    return done


def _timed_recomputes(server: SGLangServer, reasons: Sequence[str] = CHOSEN,
                      started: bool = True) -> float:
    """Prompt tokens an `adaptive` server recomputed by choice, for one of `reasons`; a server
    not `started` (before its first request) may not export its planner's counts yet."""
    metrics = kvtier_metrics(server)
    assert not started or "kvtier_adaptive_tokens_loaded_total" in metrics, \
        "an adaptive server's metrics"
    return sum(metrics.get(f"kvtier_adaptive_tokens_recomputed_{reason}_total", 0.0)
               for reason in reasons)


def check_partial_hit(server: SGLangServer, seed: int) -> None:
    """A prompt sharing two whole chunks (and part of a third) with a stored one loads
    exactly those two chunks."""
    base = prompt(seed, PROMPT_LEN)
    server.generate(base)
    shared = 2 * CHUNK + 8
    ids = base[:shared] + prompt(seed + 1000, PROMPT_LEN - shared)
    expected = cold(server, ids)
    server.flush_cache()

    got = server.generate(ids)
    assert got["meta_info"]["cached_tokens"] == 2 * CHUNK
    assert got["output_ids"] == expected


def check_unrelated_miss(server: SGLangServer, seed: int) -> None:
    server.generate(prompt(seed, PROMPT_LEN))
    server.flush_cache()
    ids = prompt(seed + 1000, PROMPT_LEN)
    got = server.generate(ids)
    assert got["meta_info"]["cached_tokens"] == 0
    assert got["output_ids"] == cold(server, ids)


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct (trained weights), converted once into the user's cache
    (`make sglang-env` does it ahead; kvtier/demo/smollm2.py)."""
    from kvtier.demo.smollm2 import cached_smollm2

    return cached_smollm2()[0]
