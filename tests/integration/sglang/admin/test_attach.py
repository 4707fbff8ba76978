"""Tier attach on one rank: validated on the caller's thread, built on its own, published in a
second phase (or thrown away), never by anything HTTP names itself."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.redis import RedisProcess, free_port
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError
from kvtier.integration.sglang.admin.attach import MAX_TIMEOUT_S, Attachments, attach_config
from tests.helpers import SMALL_MHA


def _until(check, what: str, timeout: float = 60) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout  # a bound on a hang, not a timing assertion
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def declared(redis_server: RedisProcess, tmp_path: Path) -> Config:
    return Config(chunk_size=16, max_local_cpu_size=0.01, remote_url=redis_server.url,
                  remote_timeout_secs=1.0, local_disk=str(tmp_path / "d"),
                  max_local_disk_size=0.1)


@pytest.fixture
def engine(declared: Config) -> Iterator[CacheEngine]:
    pool = [torch.zeros(8, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim, dtype=SMALL_MHA.dtype)
            for _ in range(2 * SMALL_MHA.num_layers)]
    eng = CacheEngine(dataclasses.replace(declared, remote_url=None, local_disk=None),
                      model_name="m", layout=SMALL_MHA,
                      connector=SGLangMHAConnector(pool[::2], pool[1::2]))
    yield eng
    eng.close()


def test_http_may_attach_only_declared_tiers_and_behaviour_keys(declared: Config) -> None:
    assert attach_config(declared, "redis", {"remote_timeout_secs": 3}).remote_timeout_secs == 3
    assert attach_config(declared, "disk", {"max_local_disk_size": 0.05}).local_disk == \
        declared.local_disk
    for tier, overrides, named in (
            ("redis", {"remote_url": "redis://evil:6379"}, "remote_url"),
            ("disk", {"local_disk": "/tmp/elsewhere"}, "local_disk"),
            ("redis", {"chunk_size": 32}, "chunk_size"),
            ("redis", {"remote_timeout_secs": MAX_TIMEOUT_S + 1}, "remote_timeout_secs"),
            ("disk", {"max_local_disk_size": 10**9}, "max_local_disk_size: 1e\\+09 GB is more "
             "than the filesystem"),  # checked against the host, as the launch does
            ("cpu", {}, "tier")):
        with pytest.raises(ValueError, match=named) as err:
            attach_config(declared, tier, overrides)
        assert "evil" not in str(err.value)
    with pytest.raises(ValueError, match="not declared"):
        attach_config(dataclasses.replace(declared, remote_url=None), "redis", {})
    with pytest.raises(ConfigError, match="remote_ttl_secs"):
        attach_config(declared, "redis", {"remote_ttl_secs": -1})


def test_a_tier_is_built_in_the_background_and_published_on_commit(
        engine: CacheEngine, declared: Config) -> None:
    attach = Attachments(engine)
    attach.start("redis", declared)
    with pytest.raises(ValueError, match="already"):
        attach.start("redis", declared)
    _until(lambda: attach.states()["redis"]["state"] == "built", "never built")
    assert engine.tiers.names == ["cpu"]  # built, not yet published
    attach.commit("redis")
    assert engine.tiers.names == ["cpu", "redis"] and attach.states() == {}
    with pytest.raises(ValueError, match="cannot be committed"):
        attach.commit("redis")


def test_an_unreachable_tier_fails_and_is_never_published(
        engine: CacheEngine, declared: Config) -> None:
    attach = Attachments(engine)
    dead = dataclasses.replace(declared, remote_url=f"redis://127.0.0.1:{free_port()}")
    attach.start("redis", dead)
    _until(lambda: attach.states()["redis"]["state"] != "building", "never ended")
    state = attach.states()["redis"]
    assert state["state"] == "failed" and "unreachable" in state["error"]
    with pytest.raises(ValueError):
        attach.commit("redis")
    attach.abort("redis")
    assert engine.tiers.names == ["cpu"] and attach.states() == {}


def test_an_attach_aborted_while_it_builds_is_thrown_away(
        engine: CacheEngine, declared: Config) -> None:
    with socket.create_server(("127.0.0.1", 0)) as tarpit:  # accepts, never answers
        url = f"redis://127.0.0.1:{tarpit.getsockname()[1]}"
        attach = Attachments(engine)
        attach.start("redis", dataclasses.replace(declared, remote_url=url), commit=True)
        assert attach.states()["redis"]["state"] == "building"  # start() did not wait
        attach.abort("redis")
        assert attach.states() == {}
        threads = [t for t in threading.enumerate() if t.name == "kvtier-attach-redis"]
        for t in threads:
            t.join(60)
        assert engine.tiers.names == ["cpu"]
