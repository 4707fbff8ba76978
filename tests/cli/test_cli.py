from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.cli import main
from kvtier.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    cfg = load_config(path, env={})
    assert cfg.chunk_size % 16 == 0


def test_check_config_prints_effective_values(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 64\nremote_url: redis://u:hunter2@localhost:1/0\n")
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert data["effective"]["chunk_size"] == 64 and "hunter2" not in out
    assert data["tiers"] == "cpu -> redis"


def test_check_config_prints_the_three_key_groups(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: '64'\nuse_layerwise: true\nremote_serde: cachegen\n"
                    "remote_url: resp://127.0.0.1:1\nextra_config:\n  password: hunter2\n"
                    "  resp_num_threads: 8\n")
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert data["kvtier_keys"] == {"chunk_size": "64"}
    translated = data["lmcache_translated"]
    assert set(translated) == {"remote_url", "remote_serde", "extra_config"}
    assert "fp8" in translated["remote_serde"]  # cachegen's closest codec
    ignored = data["lmcache_not_implemented"]
    assert "layer-by-layer" in ignored["use_layerwise"]
    assert ignored["extra_config.resp_num_threads"] == "not used by kvtier"
    # migrate-config classifies every key the same way
    assert main(["migrate-config", str(path)]) == 0
    kinds = {line.split()[0]: line.split()[1]
             for line in capsys.readouterr().out.split("\n\n")[0].splitlines()}
    assert {k for k, kind in kinds.items() if kind == "kvtier"} == set(data["kvtier_keys"])
    assert {k for k, kind in kinds.items() if kind == "translated"} >= {"remote_url",
                                                                         "remote_serde"}
    assert data["effective"]["remote_url"] == "redis://:***@127.0.0.1:1"
    assert data["effective"]["chunk_size"] == 64 and "hunter2" not in out


@pytest.mark.parametrize("url", ["lm://localhost:65432", "mooncakestore://h:50051/",
                                 "s3://bucket", "external://h:0/x", "redis://h:1?password=pw1"])
def test_check_config_rejects_a_remote_url_kvtier_cannot_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str,
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"remote_url: '{url}'\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "remote_url" in err and "pw1" not in err


def test_migrate_config_maps_each_key(capsys: pytest.CaptureFixture[str]) -> None:
    corpus = ROOT / "tests" / "lmcache_configs"
    assert main(["migrate-config", str(corpus / "resp_remote.yaml")]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()
            if line and not line.startswith("#") and ":" not in line.split()[0]}
    assert rows["chunk_size"] == "kvtier" and rows["remote_url"] == "translated"
    assert rows["extra_config.resp_num_threads"] == "ignored"
    assert rows["extra_config.password"] == "translated"
    assert "kvpass" not in out
    tail = yaml.safe_load(out.split("credentials masked):", 1)[1])
    assert tail["remote_url"] == "redis://kvuser:***@localhost:6379"
    assert tail["max_local_cpu_size"] == 1.0 and tail["local_cpu"] is False


def test_migrate_config_reports_keys_then_the_error(capsys: pytest.CaptureFixture[str]) -> None:
    corpus = ROOT / "tests" / "lmcache_configs"
    assert main(["migrate-config", str(corpus / "mooncake.yaml")]) == 2
    captured = capsys.readouterr()
    assert "extra_config.metadata_server" in captured.out
    assert "remote_url" in captured.err and "mooncakestore" in captured.err


def test_check_config_error_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunksize: 64\n")
    assert main(["check-config", str(path)]) == 2
    assert "chunk_size" in capsys.readouterr().err


def test_info_reports_kernel_and_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "copy kernel" in out and "tier cpu" in out and "ok" in out
    assert "sglang internals" not in out  # only with --sglang: importing SGLang takes seconds


def test_info_says_why_the_reference_kernel_in_its_table_not_in_a_log_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVTIER_KERNEL", "torch")
    with caplog.at_level(logging.DEBUG):
        assert main(["info"]) == 0
    out, err = capsys.readouterr()
    assert "copy kernel  torch: KVTIER_KERNEL=torch: using the PyTorch reference" in out
    assert err == "" and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_info_shows_sizes_in_human_units(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         redis_server: Any) -> None:
    disk = tmp_path / "disk"
    cfg = _tiers_config(tmp_path, disk, f"{redis_server.url}/6")
    _seed(cfg)
    assert main(["info", str(cfg)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("tier disk"))
    assert re.search(r"bytes=\d[\d.]* (kB|MB|GB)\b", line), line
    assert "e+" not in out


def test_bench_writes_json(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("chunk_size: 16\nmax_local_cpu_size: 0.2\n")
    out = tmp_path / "bench.json"
    # A subprocess: the console entry point as a user runs it.
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", str(cfg), "--prompts",
                           "2", "--tokens", "64", "--json", str(out), "-q"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["tiers"]["cpu"]["tokens_loaded"] == 128
    assert result["stats"]["tokens_stored"] == 128
    assert "gather (connector)" in proc.stdout
    assert "advised for huge pages" in result["pool_huge_pages"]  # as a server's CPU pool


def test_info_shows_an_unreachable_redis_as_down(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"max_local_cpu_size: 0.01\nremote_url: redis://127.0.0.1:{port}/0\n")
    assert main(["info", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "tier redis" in out and "DOWN" in out


# -- bench and info against real tiers: a disk directory and a redis-server of the fixtures --

BENCH_ARGS = ["--prompts", "2", "--tokens", "64", "-q"]


def _tiers_config(tmp_path: Path, disk: Path, redis_url: str) -> Path:
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text(f"chunk_size: 16\nmax_local_cpu_size: 0.2\nlocal_disk: {disk}\n"
                   f"max_local_disk_size: 1\nremote_url: {redis_url}\n")
    return cfg


def _seed(cfg: Path) -> None:
    """Records a serving instance stored: model "prod" in the disk directory and Redis."""
    import torch

    from kvtier.connectors import SGLangMHAConnector
    from kvtier.engine import CacheEngine
    from tests.helpers import SMALL_MHA

    shape = (256, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim)
    pool = [torch.randn(shape).to(SMALL_MHA.dtype) for _ in range(2 * SMALL_MHA.num_layers)]
    connector = SGLangMHAConnector(pool[:SMALL_MHA.num_layers], pool[SMALL_MHA.num_layers:])
    with CacheEngine(load_config(cfg), model_name="prod", layout=SMALL_MHA,
                     connector=connector) as engine:
        for seed in range(3):
            ids = torch.randint(0, 30_000, (64,), generator=torch.Generator().manual_seed(seed))
            assert engine.store(ids, torch.arange(64)) == 64
    # close() drained the writers: the records are on disk and in Redis now


def _files(root: Path, *, dirs: bool) -> dict[str, tuple[bytes | None, int]]:
    """Every file under `root` as (contents, mtime); with `dirs`, the directories too (root
    included) as (None, mtime), so a file created and removed again shows."""
    out: dict[str, tuple[bytes | None, int]] = {}
    if dirs:
        out["."] = (None, root.lstat().st_mtime_ns)
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_dir():
            if dirs:
                out[rel] = (None, path.lstat().st_mtime_ns)
        else:
            out[rel] = (path.read_bytes(), path.lstat().st_mtime_ns)
    return out


def _redis_contents(client: Any) -> dict[bytes, bytes]:
    return {key: client.dump(key) for key in client.scan_iter(count=1000)}


def test_bench_with_real_tiers_deletes_what_it_wrote(tmp_path: Path, redis_server: Any) -> None:
    disk = tmp_path / "disk"
    cfg = _tiers_config(tmp_path, disk, f"{redis_server.url}/3")
    _seed(cfg)
    client = redis_server.client(db=3)
    files, keys = _files(disk, dirs=False), _redis_contents(client)
    assert any(name.endswith(".kvt") for name in files) and keys
    out = tmp_path / "bench.json"
    assert main(["bench", str(cfg), *BENCH_ARGS, "--json", str(out), "--real-tiers"]) == 0
    result = json.loads(out.read_text())
    # It measured the configured tiers ...
    assert result["scratch"]["real_tiers"] and result["scratch"]["model"].startswith("bench-")
    assert result["tiers"]["disk"]["tokens_loaded"] == 128
    assert result["tiers"]["redis"]["tokens_loaded"] == 128
    # ... in an arena of its working set (8 chunks of 2 MiB and slack), not max_local_cpu_size
    assert result["scratch"]["arena_bytes"] < 0.2e9 / 4
    # ... and left them as it found them: its records and directories gone, the others intact.
    assert _files(disk, dirs=False) == files
    assert {p.relative_to(disk) for p in disk.rglob("*") if p.is_dir()} == {
        Path(name).parent for name in files} | {Path(name).parent.parent for name in files}
    assert _redis_contents(client) == keys


def test_bench_without_real_tiers_leaves_the_configured_ones_untouched(
        tmp_path: Path, redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = tmp_path / "disk"
    cfg = _tiers_config(tmp_path, disk, f"{redis_server.url}/4")
    _seed(cfg)
    client = redis_server.client(db=4, single_connection_client=True)
    files, keys = _files(disk, dirs=True), _redis_contents(client)
    connections = client.info("stats")["total_connections_received"]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "bench.json"
    assert main(["bench", str(cfg), *BENCH_ARGS, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tiers"]["disk"]["tokens_loaded"] == 128  # a temporary directory ...
    assert "redis" not in result["tiers"]
    assert list(scratch.iterdir()) == []  # ... removed at the end
    assert _files(disk, dirs=True) == files  # not even a directory entry changed
    assert client.info("stats")["total_connections_received"] == connections  # never connected
    assert _redis_contents(client) == keys


# Commands `info` may send: connection set-up, PING and server introspection.
_READ_ONLY = {"ping", "hello", "client|setinfo", "client|setname", "select", "info", "auth",
              "cluster|slots", "cluster|shards", "command", "command|docs"}


def test_info_changes_nothing_in_the_tiers(tmp_path: Path, redis_server: Any,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "disk"
    cfg = _tiers_config(tmp_path, disk, f"{redis_server.url}/5")
    _seed(cfg)
    # A stale temp file: the disk tier's start-up would delete it, `info` must not.
    record = next(disk.rglob("*.kvt"))
    stale = record.parent / f"{record.stem}.{os.getpid()}.0.tmp"
    stale.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    client = redis_server.client(db=5)
    files, keys = _files(disk, dirs=True), _redis_contents(client)
    client.config_resetstat()
    assert main(["info", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "tier disk" in out and "entries=12" in out and "tier redis" in out  # 3 x 4 chunks
    assert "UNAVAILABLE" not in out and "DOWN" not in out
    assert _files(disk, dirs=True) == files
    assert _redis_contents(client) == keys
    sent = {name.removeprefix("cmdstat_") for name in client.info("commandstats")}
    assert sent - {"config|resetstat", "scan", "dump"} <= _READ_ONLY, sent


def test_info_does_not_create_a_missing_disk_directory(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"max_local_cpu_size: 0.01\nlocal_disk: {tmp_path}/absent/kv\n"
                   "max_local_disk_size: 1\n")
    assert main(["info", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "tier disk" in out and "does not exist" in out
    assert not (tmp_path / "absent").exists()
