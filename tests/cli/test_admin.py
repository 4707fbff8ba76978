"""`kvtier stats | ls | purge` over real disk and Redis tiers (standalone and cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from harness.redis import RedisCluster, RedisProcess
from kvtier.cli import main
from kvtier.config import load_config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from tests.helpers import SMALL_MHA

CHUNK = 16


def _store(cfg_path: Path, model: str, seeds: range) -> None:
    pool = [torch.randn(400, 2, 8).to(SMALL_MHA.dtype) for _ in range(4)]
    with CacheEngine(load_config(cfg_path), model_name=model, layout=SMALL_MHA,
                     connector=SGLangMHAConnector(pool[:2], pool[2:])) as engine:
        for seed in seeds:
            ids = torch.randint(0, 30_000, (64,), generator=torch.Generator().manual_seed(seed))
            assert engine.store(ids, torch.arange(1, 65)) == 64
        assert engine.flush()


def _config(tmp_path: Path, url: str, disk: bool = True) -> Path:
    path = tmp_path / "kvtier.yaml"
    data = {"chunk_size": CHUNK, "max_local_cpu_size": 0.01, "remote_url": url}
    if disk:
        data.update(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1)
    path.write_text(yaml.safe_dump(data))
    return path


def test_ls_stats_and_purge_one_model(tmp_path: Path, redis_factory,  # noqa: ANN001
                                      capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    redis: RedisProcess = redis_factory()
    cfg = _config(tmp_path, redis.url)
    _store(cfg, "alpha", range(2))  # 2 prompts x 4 chunks
    _store(cfg, "beta", range(10, 13))  # 3 prompts x 4 chunks

    assert main(["ls", str(cfg)]) == 0
    out = capsys.readouterr().out
    rows = {(line.split()[0], line.split()[3], int(line.split()[1]))
            for line in out.splitlines()[1:]}
    assert rows == {("disk", "alpha", 8), ("redis", "alpha", 8), ("disk", "beta", 12),
                    ("redis", "beta", 12)}
    assert main(["stats", str(cfg)]) == 0
    stats = capsys.readouterr().out
    assert any(line.split()[:2] == ["disk", "20"] for line in stats.splitlines())
    assert any(line.split()[:2] == ["redis", "20"] for line in stats.splitlines())

    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["purge", str(cfg), "--model", "alpha"]) == 2  # no terminal, no --yes
    assert "--yes" in capsys.readouterr().err
    assert main(["purge", str(cfg), "--model", "alpha", "--yes"]) == 0
    assert "deleted 8 chunks" in capsys.readouterr().out
    assert main(["ls", str(cfg)]) == 0
    left = capsys.readouterr().out
    assert "alpha" not in left and left.count("beta") == 2
    assert redis.client().dbsize() == 12


def test_ls_and_purge_span_every_cluster_primary(
        tmp_path: Path, redis_cluster: RedisCluster,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, redis_cluster.url, disk=False)
    _store(cfg, "gamma", range(20, 25))  # 20 chunks spread over the slots
    assert main(["ls", str(cfg), "--model", "gamma"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [["redis", "20"]]
    assert main(["purge", str(cfg), "--model", "gamma", "--yes"]) == 0
    assert "deleted 20 chunks" in capsys.readouterr().out
    assert main(["ls", str(cfg), "--model", "gamma"]) == 0
    assert "nothing stored" in capsys.readouterr().out


def test_a_tenant_limited_by_acl_lists_only_its_namespace(
        tmp_path: Path, redis_factory,  # noqa: ANN001
        capsys: pytest.CaptureFixture[str]) -> None:
    redis: RedisProcess = redis_factory()
    for name in ("a", "b"):  # two tenants' records, written by the admin (default user)
        (tmp_path / name).mkdir()
        path = _config(tmp_path / name, redis.url, disk=False)
        data = yaml.safe_load(path.read_text())
        path.write_text(yaml.safe_dump({**data, "key_namespace": f"tenant-{name}"}))
        _store(path, f"model-{name}", range(2))
    # Tenant a may read its own prefix only; SCAN itself is not filtered by key patterns.
    redis.client().execute_command("ACL", "SETUSER", "ta", "on", ">ta-pass",
                                   "~kvtier/v2/tenant-a/*", "+@read", "+@connection", "+scan")
    tenant = tmp_path / "tenant.yaml"
    tenant.write_text(yaml.safe_dump({
        "chunk_size": CHUNK, "max_local_cpu_size": 0.01, "key_namespace": "tenant-a",
        "remote_url": f"redis://ta:ta-pass@127.0.0.1:{redis.port}"}))
    assert main(["ls", str(tenant)]) == 0
    out = capsys.readouterr().out
    assert "model-a" in out and "tenant-b" not in out and "model-b" not in out
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("redis", "8")]
    assert main(["stats", str(tenant)]) == 0
    assert "model-b" not in capsys.readouterr().out


# -- issue 36, item 7: purge deletes only the tier's own record files ------------------------

def _disk_config(tmp_path: Path, disk: Path) -> Path:
    path = tmp_path / "disk.yaml"
    path.write_text(yaml.safe_dump({"chunk_size": CHUNK, "max_local_cpu_size": 0.01,
                                    "local_disk": str(disk), "max_local_disk_size": 0.1}))
    return path


def test_purge_deletes_only_record_files_and_follows_no_symlink(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    disk, outside = tmp_path / "disk", tmp_path / "outside"
    cfg = _disk_config(tmp_path, disk)
    _store(cfg, "alpha", range(2))  # 8 records
    stored = sorted(disk.glob("*/*/*.kvt"))
    assert len(stored) == 8
    outside.mkdir()
    record = "ab" * 32  # a record name (of no stored key) for ab/ab/
    bait = {outside / f"{record}.kvt": b"outside the root", outside / "notes.txt": b"mine"}
    for path, data in bait.items():
        path.write_bytes(data)
    (disk / "ab" / "ab").mkdir(parents=True, exist_ok=True, mode=0o700)
    foreign = {disk / "ab" / "ab" / "notes.kvt": b"not a record name",
               disk / "ab" / "ab" / "abab-notes.kvt": b"nor this, in the directory it names",
               disk / "ab" / "ab" / "abab.kvt": b"nor this",
               disk / "ab" / "ab" / f"{record}.kvt.orig": b"nor this",
               disk / "readme.kvt": b"nor this"}
    for path, data in foreign.items():
        path.write_bytes(data)
    (disk / "cd").mkdir(exist_ok=True, mode=0o700)
    (disk / "cd" / "cd").symlink_to(outside)  # a symlinked ab/cd directory
    (disk / "ab" / "ab" / f"{record}.kvt").symlink_to(outside / "notes.txt")  # at a record path
    assert main(["purge", str(cfg), "--yes"]) == 0
    assert "deleted 8 chunks" in capsys.readouterr().out
    assert not any(p.exists() for p in stored)
    for path, data in {**bait, **foreign}.items():
        assert path.read_bytes() == data, path
    assert (disk / "ab" / "ab" / f"{record}.kvt").is_symlink()


@pytest.mark.parametrize("where, why", [
    ("root", "is the filesystem root"), ("home", "is the home directory"),
    ("above home", "holds the home directory"), ("symlink", "goes through the symlink"),
])
@pytest.mark.parametrize("command", [["ls"], ["stats"], ["purge", "--yes"]],
                         ids=lambda c: c[0])
def test_ls_stats_and_purge_refuse_a_dangerous_local_disk(
        where: str, why: str, command: list[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "users" / "me"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    disk = {"root": Path("/"), "home": home, "above home": home.parent,
            "symlink": tmp_path / "link"}[where]
    assert main([*command, str(_disk_config(tmp_path, disk))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: local_disk: ") and why in err
    assert len(err.strip().splitlines()) == 1


def test_stats_ls_and_purge_show_a_down_redis_as_one_row(
        tmp_path: Path, redis_factory, capsys: pytest.CaptureFixture[str],  # noqa: ANN001
        monkeypatch: pytest.MonkeyPatch) -> None:
    redis: RedisProcess = redis_factory()
    cfg = _config(tmp_path, redis.url)
    _store(cfg, "alpha", range(2))
    redis.stop()  # the tier is now down: the disk tier must still be listed and purged

    assert main(["ls", str(cfg)]) == 1
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [["disk", "8"], ["redis", "-"]]
    assert "DOWN" in lines[-1] and "Traceback" not in out.err
    assert main(["stats", str(cfg)]) == 1
    stats = capsys.readouterr().out.splitlines()
    assert stats[1].split()[:2] == ["disk", "8"] and "DOWN" in stats[2]

    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["purge", str(cfg), "--yes"]) == 1
    out = capsys.readouterr().out
    assert "deleted 8 chunks" in out and "redis: DOWN, nothing deleted there" in out
    assert not list((tmp_path / "disk").rglob("*.kvt"))


def test_help_is_for_users_and_imports_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; from kvtier.cli.main import build_parser; "
            "h = build_parser().format_help(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(h)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: kvtier")
    assert "check-config" in done.stdout and "MAX_CONFIG_BYTES" not in done.stdout


def test_purge_without_a_terminal_names_every_persistent_tier(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With `local_cpu: false` the disk tier comes first in the config's tiers; the refusal
    still names it (it used to drop the first tier, taking it for the CPU tier)."""
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"local_cpu": False, "local_disk": str(tmp_path / "disk"),
                                    "max_local_disk_size": 0.1}))
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["purge", str(path)]) == 2
    assert "purge would delete every model from disk;" in capsys.readouterr().err


def test_purge_of_an_empty_model_name_is_refused_naming_the_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `--model ""` named no model, yet the prompt said "every model": refused before anything.
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(yaml.safe_dump({"chunk_size": CHUNK, "max_local_cpu_size": 0.01,
                                   "local_disk": str(tmp_path / "disk"),
                                   "max_local_disk_size": 0.1}))
    assert main(["purge", str(cfg), "--model", "", "--yes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: --model: ") and len(err.strip().splitlines()) == 1
