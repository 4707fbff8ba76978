from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvtier.cli import main
from kvtier.config import load_config

ROOT = Path(__file__).resolve().parents[1]


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
    assert data["kvtier_keys"] == {"chunk_size": "64", "remote_url": "resp://127.0.0.1:1",
                                   "remote_serde": "cachegen"}
    ignored = data["lmcache_not_implemented"]
    assert "layer-by-layer" in ignored["use_layerwise"]
    assert ignored["extra_config.resp_num_threads"] == "not used by kvtier"
    assert "uncompressed" in ignored["remote_serde (value translated)"]
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
