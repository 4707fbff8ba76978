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
    assert data["chunk_size"] == 64 and "hunter2" not in out
    assert "cpu -> redis" in out


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
