"""`kvtier purge --tenant SALT --server URL`'s refusals, before anything is deleted: a server
needs a tenant (never a whole CPU tier), a plain http:// server off loopback needs --insecure
(the salt and the admin key would cross the network in clear), and without --yes off a
terminal the command says where it would delete. The purge itself runs against a real server
in tests/integration/sglang/test_sglang_forget_tenant.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvtier.cli import main


def _config(tmp_path: Path) -> str:
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"chunk_size": 16, "local_disk": str(tmp_path / "disk"),
                                   "max_local_disk_size": 0.01}))
    (tmp_path / "disk").mkdir(mode=0o700)
    (tmp_path / "disk" / "keep").write_text("not a record")
    return str(path)


def test_a_server_needs_a_tenant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["purge", _config(tmp_path), "--server", "http://127.0.0.1:9", "--yes"]) == 2
    assert "--server: give --tenant SALT too" in capsys.readouterr().err
    assert (tmp_path / "disk" / "keep").exists()


def test_plain_http_off_loopback_is_refused(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["purge", _config(tmp_path), "--tenant", "secret-salt", "--server",
                 "http://10.1.2.3:30000", "--yes"]) == 2
    err = capsys.readouterr().err
    assert "refusing plain http:// to 10.1.2.3" in err and "secret-salt" not in err


def test_without_yes_it_says_where_and_deletes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["purge", _config(tmp_path), "--tenant", "secret-salt", "--server",
                 "http://127.0.0.1:9"]) == 2  # stdin is not a terminal under pytest
    err = capsys.readouterr().err
    assert "from disk, the CPU tiers of http://127.0.0.1:9; not a terminal" in err
    assert "secret-salt" not in err


def test_an_unreachable_server_fails_the_command_and_the_config_is_still_purged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["purge", _config(tmp_path), "--tenant", "secret-salt", "--server",
                 "http://127.0.0.1:9", "--yes"]) == 1
    out = capsys.readouterr().out
    assert "http://127.0.0.1:9: nothing deleted there: cannot reach it" in out
    assert "nothing to delete in the config's disk/Redis tiers" in out
    assert "secret-salt" not in out
