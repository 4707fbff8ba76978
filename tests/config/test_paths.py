"""`local_disk` as LMCache reads it (kvtier.config.paths): `file://` stripped, the rest a path,
a relative one under the working directory, named in one warning; what LMCache could not use
either is still refused by name."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvtier.backends import BackendContext
from kvtier.backends.disk import DiskBackend
from kvtier.config import Config, load_config
from kvtier.errors import ConfigError
from kvtier.memory import MemoryAllocator
from tests.helpers import SMALL_MHA

# given -> the directory LMCache's disk backend would make, relative to the working directory
# (LMCache removes a leading "file://" and passes the rest to os.makedirs), or None where the
# given path is absolute (it is the directory).
SPELLINGS = [
    ("file://local_disk/", "local_disk"),  # LMCache's own SGLang/blending examples
    ("file://local_disk", "local_disk"),
    ("local_disk/", "local_disk"),
    ("./cache/../kv", "kv"),
    ("file://localhost/kv", "localhost/kv"),  # no host part: LMCache makes ./localhost/kv
    ("file://otherhost/kv", "otherhost/kv"),
    ("file:///srv/kv/", None),
    ("/srv/kv", None),
    ("  file:///srv/kv/ ", None),
]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(("given", "relative"), SPELLINGS)
def test_each_spelling_resolves_as_lmcache_reads_it(
    given: str, relative: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = Config(local_disk=given, max_local_disk_size=1)
    expected = Path("/srv/kv") if relative is None else tmp_path / relative
    assert cfg.local_disk_path == expected
    warnings = _warnings(caplog)
    if relative is None:
        assert warnings == []
        return
    assert len(warnings) == 1 and f"puts the disk tier in {expected} " in warnings[0]
    assert f"local_disk: {given!r}" in warnings[0]
    if given.startswith("file://"):  # says how LMCache read the URL
        assert f"the relative path {given.removeprefix('file://')!r}" in warnings[0]


def test_a_relative_disk_is_resolved_once_where_the_file_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    start, later = tmp_path / "start", tmp_path / "later"
    start.mkdir()
    later.mkdir()
    path = tmp_path / "c.yaml"
    path.write_text("local_disk: file://local_disk/\nmax_local_disk_size: 0.01\n")
    monkeypatch.chdir(start)
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(path, env={})
    [warning] = _warnings(caplog)  # one warning, naming the absolute path
    assert str(start / "local_disk") in warning
    monkeypatch.chdir(later)  # the tier stays where the load resolved it
    alloc = MemoryAllocator(1 << 20)
    DiskBackend(BackendContext(config=cfg, layout=SMALL_MHA, allocator=alloc)).close()
    assert (start / "local_disk").is_dir() and list(later.iterdir()) == []


def test_a_relative_disk_without_a_working_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(ConfigError, match=r"local_disk: 'file://kv/' is relative and the "
                                          "working directory cannot be read"):
        Config(local_disk="file://kv/", max_local_disk_size=1)


@pytest.mark.parametrize(("given", "why"), [
    ("file://", "must be a directory path or file:///path URL"),
    ("file://s3://bucket/kv", "must be a directory path or file:///path URL"),
    ("redis://localhost:6379", "must be a directory path or file:///path URL"),
    ("file://kv\0x", "holds a NUL byte"),
    ("file:///a/,file:///b/", "several disks"),
    ("d" * 1030, "at most 1024"),
    ("d" * 1020, "at most 1024"),  # short enough as written, too long once made absolute
])
def test_what_lmcache_could_not_use_either_is_refused_as_written(
    given: str, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="^config: local_disk: ") as info:
        Config(local_disk=given, max_local_disk_size=1)
    assert why in str(info.value)
    assert list(tmp_path.iterdir()) == [] and os.getcwd() == str(tmp_path)
