"""The stop, without an SGLang server: the drain's report counts every lower-tier write lost
since the start (a paused Redis lost them all and the stop said "0 dropped"), and the
launcher's wait for the schedulers' drains survives stray names in its stop directory.
Real servers stop in test_sglang_shutdown.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from harness.redis import RedisProcess
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from kvtier.integration.sglang.stop import shutdown, stop_wait
from tests.helpers import SMALL_MHA

CHUNK, TOKENS = 16, 64
BOUND_S = 30.0  # a bound on a hang, never expected to pass


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A server of this test's own: it is paused (SIGSTOP by its pid)."""
    server = RedisProcess(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
        server.stop(signal.SIGKILL)


@pytest.fixture
def kv(redis: RedisProcess) -> Iterator[SGLangKVTier]:
    shape = (4 * TOKENS, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim)
    pool = [torch.randn(shape).to(SMALL_MHA.dtype) for _ in range(2 * SMALL_MHA.num_layers)]
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.01, remote_url=redis.url,
                 remote_timeout_secs=0.3, blocking_timeout_secs=5.0)
    engine = CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                         connector=SGLangMHAConnector(pool[::2], pool[1::2]))
    adapter = SGLangKVTier(engine, page_size=1)
    yield adapter
    if redis.pid is not None:  # closing writes what is left; not into a paused server
        os.kill(redis.pid, signal.SIGCONT)
    adapter.close()
    engine.close()


def _store(kv: SGLangKVTier, prompt: int) -> None:
    tokens = torch.arange(TOKENS) + 1000 * prompt  # a chain of its own per prompt
    assert kv.engine.store(tokens, torch.arange(TOKENS)) == TOKENS


def test_the_stop_counts_the_writes_a_paused_redis_lost(
        kv: SGLangKVTier, redis: RedisProcess, caplog: pytest.LogCaptureFixture) -> None:
    before = kv.engine.write_backlog().written
    _store(kv, 0)
    healthy = shutdown.drain(kv, BOUND_S)
    # The writer may have written some or all of the 4 before the drain began (a busy CI host
    # saw all 4 written first): the drain counts what it wrote, the backlog everything.
    assert kv.engine.write_backlog().written - before == 4, healthy
    assert healthy.written <= 4 and (healthy.dropped, healthy.lost_total) == (0, 0), healthy
    assert redis.pid is not None
    os.kill(redis.pid, signal.SIGSTOP)  # paused: every call on it times out
    for prompt in (1, 2, 3):
        _store(kv, prompt)
    done = shutdown.drain(kv, BOUND_S)
    # The first call times out and marks the tier down; the others are skipped: nothing lands.
    stats = kv.engine.stats()
    (loss,) = done.lost
    assert loss.tier == "redis" and done.dropped == 0 and done.written == 0, done
    assert loss.total == stats["redis.writes_lost"] == 12, (done, stats)
    assert loss.failed + loss.orphaned == 12, loss
    # Every chunk put is accounted for: written, held already, lost or still queued.
    assert stats["chunks_put"] == stats["redis.writes"] + stats.get("redis.write_present", 0) \
        + loss.total + done.dropped
    with caplog.at_level(logging.INFO, logger=shutdown.__name__):
        shutdown.drain_and_log(kv)
    (line,) = [r for r in caplog.records if "kvtier: stopping:" in r.getMessage()]
    assert line.levelno == logging.WARNING, line.getMessage()
    assert "0 dropped" in line.getMessage()  # nothing was still queued at the stop ...
    assert "12 writes lost since the start: redis 12 (" in line.getMessage()  # ... but these


_SCHEDULER = """
import os, pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[1]) / str(os.getpid())
def drained(signum, frame):
    marker.unlink()  # the report a scheduler gives when its drain is done
    os._exit(0)
signal.signal(signal.SIGTERM, drained)
marker.touch()
while True:
    time.sleep(0.05)
"""


def test_stray_names_in_the_stop_directory_cost_no_drain(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stop_dir = tmp_path / "stop"
    stop_dir.mkdir()
    (stop_dir / "123abc").touch()
    (stop_dir / "0123").touch()
    (stop_dir / "456").mkdir()  # a pid's name, but not a file a scheduler made
    child = subprocess.Popen([sys.executable, "-c", _SCHEDULER, str(stop_dir)])
    try:
        deadline = time.monotonic() + BOUND_S
        while not (stop_dir / str(child.pid)).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        with caplog.at_level(logging.DEBUG, logger=stop_wait.__name__):
            shutdown.drain_then_kill([psutil.Process(child.pid)], stop_dir)
        took = time.monotonic() - start
        assert child.wait(BOUND_S) == 0  # SIGTERMed, drained, reported
        assert took < shutdown.DRAIN_S, took  # its report was seen: no wait for the bound
        assert not stop_dir.exists()
        text = caplog.text
        assert "still draining" not in text and "stopped before their drain" not in text, text
        assert text.count("'123abc'") == 1 and "'0123'" in text and "'456'" in text, text
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
