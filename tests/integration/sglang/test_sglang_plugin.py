"""The plugin's command-line flags, through SGLang's own argument parsing (in process)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError
from tests.integration.sglang.conftest import write_config

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what `python -m sglang.launch_server` does before it parses


@pytest.fixture
def config_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # A launch parsed here sets its workers' environment in this process (KVTIER_CONFIG_FILE,
    # the CPU engine's variables, SGLANG_CPU_OMP_THREADS_BIND at --tp-size 2): every server a
    # later test starts would inherit them, so the whole environment is put back.
    saved = dict(os.environ)
    monkeypatch.setenv("KVTIER_CONFIG_FILE", "")
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)


def parse(model: Path, *args: str) -> Any:
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", str(model), "--device", "cpu", *args])


def test_flags_are_in_sglangs_help() -> None:
    parser = argparse.ArgumentParser()
    from sglang.srt.server_args import ServerArgs

    ServerArgs.add_cli_args(parser)
    text = parser.format_help()
    assert "--enable-kvtier" in text and "--kvtier-config-file" in text


def test_enable_kvtier_selects_the_radix_cache_backend(
        config_env: None, tiny_llama: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "kvtier.yaml")
    args = parse(tiny_llama, "--enable-kvtier", "--kvtier-config-file", str(config),
                 "--page-size", "16")
    assert args.radix_cache_backend == "kvtier"
    assert parse(tiny_llama).radix_cache_backend is None


def test_chunk_size_not_a_multiple_of_page_size_fails_at_launch(
        config_env: None, tiny_llama: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "kvtier.yaml")  # chunk_size 16
    with pytest.raises(ConfigError, match=r"kvtier\.yaml: chunk_size: 16 .*--page-size \(32\)"):
        parse(tiny_llama, "--enable-kvtier", "--kvtier-config-file", str(config),
              "--page-size", "32")


def test_bad_config_file_fails_at_launch_naming_the_key(
        config_env: None, tiny_llama: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_sise: 16\n")
    with pytest.raises(ConfigError, match="chunk_sise.*chunk_size"):
        parse(tiny_llama, "--enable-kvtier", "--kvtier-config-file", str(bad))


def test_conflicting_flags_are_rejected(config_env: None, tiny_llama: Path,
                                        tmp_path: Path) -> None:
    config = write_config(tmp_path / "kvtier.yaml")
    with pytest.raises(ConfigError, match="needs --enable-kvtier"):
        parse(tiny_llama, "--kvtier-config-file", str(config))
    with pytest.raises(ConfigError, match="--radix-cache-backend"):
        parse(tiny_llama, "--enable-kvtier", "--radix-cache-backend", "flexkv")
    with pytest.raises(ConfigError, match="--enable-hierarchical-cache"):
        parse(tiny_llama, "--enable-kvtier", "--enable-hierarchical-cache")


def test_configured_tier_without_its_package_fails_at_launch_naming_the_extra(
        config_env: None, tiny_llama: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path / "kvtier.yaml", remote_url="redis://127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "redis", None)  # as if redis-py were not installed
    with pytest.raises(ConfigError, match=r"remote_url: .*'redis'.*pip install 'kvtier\[redis\]'"):
        parse(tiny_llama, "--enable-kvtier", "--kvtier-config-file", str(config))


def test_admin_routes_are_on_sglangs_http_app(config_env: None, tiny_llama: Path,
                                              tmp_path: Path) -> None:
    from sglang.srt.entrypoints.http_server import app

    parse(tiny_llama, "--enable-kvtier", "--kvtier-config-file",
          str(write_config(tmp_path / "kvtier.yaml")))
    methods = {m for r in app.routes if getattr(r, "path", "") == "/kvtier/tiers"
               for m in r.methods}
    assert methods == {"GET", "POST"}


def test_a_scheduler_with_queued_requests_keeps_the_writers_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks on `Scheduler.process_batch_result` and `Scheduler.on_idle` tell kvtier's
    writers whether requests wait: a turn without a batch is quiet only with an empty queue."""
    from types import SimpleNamespace

    from kvtier.background import QUIET_S, EngineActivity
    from kvtier.integration.sglang.launch import scheduler_hooks as hooks

    engine = EngineActivity()
    engine.enabled = True
    monkeypatch.setattr(hooks, "ENGINE", engine)
    scheduler = SimpleNamespace(waiting_queue=["a queued request"], tree_cache=None)
    hooks.before_run_batch(scheduler)
    hooks.before_batch_result(scheduler, None)
    hooks.before_idle(scheduler)  # waiting for a store's slots, say
    assert engine.busy(time.monotonic() + QUIET_S)
    scheduler.waiting_queue.clear()
    hooks.before_idle(scheduler)
    assert not engine.busy(time.monotonic() + QUIET_S)


def test_a_bad_key_at_launch_prints_one_line_naming_it(tiny_llama: Path, tmp_path: Path) -> None:
    import subprocess

    from kvtier.demo.server import cpu_shims_dir, server_env

    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_sise: 16\n")
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_llama),
         "--device", "cpu", "--enable-kvtier", "--kvtier-config-file", str(bad)],
        env=server_env(pythonpath=[cpu_shims_dir()]), capture_output=True, text=True,
        timeout=240)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("kvtier: ")]
    assert len(lines) == 1 and "chunk_sise" in lines[0] and "chunk_size" in lines[0], out.stderr


def test_a_metrics_port_that_ranks_would_push_past_65535_fails_at_launch(
        config_env: None, tiny_llama: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "kvtier.yaml", metrics_port=65535)
    with pytest.raises(ConfigError, match=r"metrics_port: 65535 .*65534"):
        parse(tiny_llama, "--enable-kvtier", "--kvtier-config-file", str(config),
              "--tp-size", "2")


def test_the_memory_check_at_launch_counts_data_parallel_ranks_too(
        config_env: None, tiny_llama: Path, tmp_path: Path) -> None:
    from kvtier.config import physical_memory_bytes
    from kvtier.config.host import cgroup_memory_limit

    limit = min(physical_memory_bytes(), cgroup_memory_limit(None) or physical_memory_bytes())
    per_rank = round(limit * 0.4 / 1e9, 3)  # two ranks fit the host's memory, three do not
    config = write_config(tmp_path / "kvtier.yaml", max_local_cpu_size=per_rank)
    try:
        parse(tiny_llama, "--enable-kvtier", "--kvtier-config-file", str(config),
              "--dp-size", "2")
    except ConfigError as error:
        # Two fit the host, but maybe not the memory free now, which other processes on this
        # host decide (a CI job's own servers): that check counts both ranks as well.
        assert "local rank(s)" not in str(error) and "x 2 rank(s)" in str(error), error
    with pytest.raises(ConfigError, match=r"x 3 local rank\(s\)"):
        parse(tiny_llama, "--enable-kvtier", "--kvtier-config-file", str(config),
              "--dp-size", "3")
