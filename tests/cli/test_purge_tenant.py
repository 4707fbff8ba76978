"""`kvtier purge --tenant SALT`: one tenant's records leave the disk and Redis tiers, found by
the tenant tag in their key names (keyed by the record key's names secret when there is one);
no other tenant's record, nor an unsalted one, is touched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from harness.redis import RedisProcess
from kvtier.backends.sealing import name_salt
from kvtier.cli import main
from kvtier.config import load_config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.keys import TAG_PREFIX, KeySpace, tag_of_key, tenant_tag
from tests.helpers import SMALL_MHA

CHUNK = 16
PROMPTS = {"tenant-a": range(2), "tenant-b": range(10, 11), "": range(20, 21)}


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 30_000, (64,), generator=torch.Generator().manual_seed(seed))


def _engine(cfg: Path) -> CacheEngine:
    pool = [torch.randn(400, 2, 8).to(SMALL_MHA.dtype) for _ in range(4)]
    return CacheEngine(load_config(cfg), model_name="m", layout=SMALL_MHA,
                       connector=SGLangMHAConnector(pool[:2], pool[2:]))


def _config(tmp_path: Path, url: str, keyed: bool) -> Path:
    data: dict[str, object] = {"chunk_size": CHUNK, "max_local_cpu_size": 0.01,
                               "remote_url": url, "local_disk": str(tmp_path / "disk"),
                               "max_local_disk_size": 0.1}
    if keyed:
        key = tmp_path / "record.key"
        key.write_bytes(os.urandom(32).hex().encode())
        key.chmod(0o600)
        data["record_key_file"] = str(key)
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("keyed", [True, False])
def test_purge_tenant_removes_its_records_and_no_others(
        tmp_path: Path, redis_factory, keyed: bool,  # noqa: ANN001
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    redis: RedisProcess = redis_factory()
    cfg = _config(tmp_path, redis.url, keyed)
    with _engine(cfg) as engine:
        for salt, seeds in PROMPTS.items():
            for seed in seeds:
                assert engine.store(_ids(seed), torch.arange(1, 65), salt=salt) == 64
        assert engine.flush()
        a_key = engine.chunk_keys(_ids(0), salt="tenant-a")[0].key
        # One tenant's lookup never finds another's prompt: the CPU tier here, ...
        assert engine.lookup(_ids(0), salt="tenant-b") == engine.lookup(_ids(0)) == 0
        assert engine.lookup(_ids(10), salt="tenant-a") == 0
    with _engine(cfg) as fresh:  # ... and disk and Redis (an empty CPU tier)
        assert fresh.lookup(_ids(0), salt="tenant-b") == fresh.lookup(_ids(0)) == 0
        assert fresh.lookup(_ids(0), salt="tenant-a") == 64
    config = load_config(cfg)
    secret = name_salt(config.hash_salt, config.record_key_file)
    assert tag_of_key(a_key) == tenant_tag(secret, "tenant-a") and "tenant-a" not in a_key
    assert KeySpace.parse(a_key) is not None  # a tagged key parses as any other
    assert (tenant_tag("", "tenant-a") != tag_of_key(a_key)) == keyed  # keyed: no plain hash

    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["purge", str(cfg), "--tenant", "tenant-a"]) == 2  # no terminal, no --yes
    assert "of tenant tag t-" in capsys.readouterr().err
    assert main(["purge", str(cfg), "--tenant", "tenant-a", "--yes"]) == 0
    out = capsys.readouterr().out
    deleted = sorted(line.split()[-1] for line in out.splitlines() if line.startswith("deleted 8"))
    assert deleted == ["disk", "redis"], out  # 2 prompts x 4 chunks, from each tier
    assert main(["purge", str(cfg), "--tenant", "tenant-a", "--yes"]) == 0
    assert "nothing to delete" in capsys.readouterr().out
    with _engine(cfg) as fresh:  # an empty CPU tier: what it finds is on disk or in Redis
        assert [fresh.lookup(_ids(s), salt="tenant-a") for s in PROMPTS["tenant-a"]] == [0, 0]
        assert fresh.lookup(_ids(10), salt="tenant-b") == 64
        assert fresh.lookup(_ids(20)) == 64
    assert main(["ls", str(cfg)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert sorted((r[0], int(r[1])) for r in rows) == [("disk", 8), ("redis", 8)]


def test_purge_tenant_refuses_an_empty_salt(tmp_path: Path, redis_factory,  # noqa: ANN001
                                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, redis_factory().url, keyed=False)
    assert main(["purge", str(cfg), "--tenant", "", "--yes"]) != 0
    assert "--tenant" in capsys.readouterr().err
    assert TAG_PREFIX == "t-"
