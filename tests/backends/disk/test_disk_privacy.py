"""The disk tier's tree holds every user's prompts: new directories and records are private,
a root others can write, or reached through a symlink, is refused, and planted record
directories are never followed."""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.memory import MemoryAllocator, lease
from tests.backends.disk.disk_helpers import Opener, _files, _put
from tests.helpers import SMALL_MHA, make_keys, make_obj

# --- privacy: the tree holds every user's prompts ----------------------------------------------

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def _snapshot(top: Path) -> dict[str, tuple[int, int, bytes]]:
    """Everything at and under `top`, never following a symlink below it: relative path ->
    (mode, owner, content of a regular file)."""
    paths = [str(top)]
    for dirpath, dirnames, filenames in os.walk(top):
        paths += [os.path.join(dirpath, n) for n in dirnames + filenames]
    out = {}
    for path in paths:
        st = os.lstat(path)
        data = Path(path).read_bytes() if stat.S_ISREG(st.st_mode) else b""
        out[os.path.relpath(path, top)] = (st.st_mode, st.st_uid, data)
    return out


def _with_bait(root: Path) -> Path:
    """Make `root` (if needed) holding a record-like file and a stale temp file that opening a
    tier would delete: a refused root must keep both."""
    (root / "00" / "00").mkdir(parents=True, exist_ok=True)
    (root / "00" / "00" / f"{'0' * 64}.kvt").write_bytes(b"not a record")
    stale = root / "00" / "00" / f"{'0' * 64}.1.1.tmp"
    stale.write_bytes(b"stale")
    os.utime(stale, (0, 0))  # unlocked, past the grace: garbage to a tier that opens
    return root


def test_a_new_root_and_its_directories_are_private_and_records_owner_only(
    open_disk: Opener, tmp_path: Path, arena: MemoryAllocator, caplog: pytest.LogCaptureFixture,
) -> None:
    root = tmp_path / "new" / "deeper" / "disk"
    disk = open_disk(root=root)
    keys = make_keys(32)
    _put(disk, keys, arena)
    record = disk.path_for(keys[0].key)
    created = [tmp_path / "new", tmp_path / "new" / "deeper", root, record.parent.parent,
               record.parent]
    assert {str(p): stat.S_IMODE(p.stat().st_mode) for p in created} == \
        {str(p): 0o700 for p in created}
    assert [stat.S_IMODE(p.stat().st_mode) for p in _files(root)] == [0o600, 0o600]
    # nothing to warn about (INFO lines are captured too when an earlier test in this
    # process left kvtier's loggers at INFO)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert disk.stats()["puts"] == 2


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777], ids=lambda m: f"{m:o}")
def test_a_root_writable_by_others_is_refused_and_left_alone(
    open_disk: Opener, tmp_path: Path, mode: int,
) -> None:
    root = _with_bait(tmp_path / "disk")
    root.chmod(mode)
    before = _snapshot(root)
    with pytest.raises(ConfigError, match=rf"local_disk: {re.escape(str(root))} is writable by "
                                          rf"group or others \(mode {mode:o}\).*chmod go-w"):
        open_disk(root=root)
    assert _snapshot(root) == before  # not chmod-ed, nothing written, the stale temp kept


@needs_root
def test_a_root_owned_by_another_user_is_refused_and_left_alone(
    open_disk: Opener, tmp_path: Path,
) -> None:
    root = _with_bait(tmp_path / "disk")
    root.chmod(0o700)
    os.chown(root, NOBODY, -1)
    before = _snapshot(root)
    with pytest.raises(ConfigError, match=rf"local_disk: {re.escape(str(root))} is owned by "
                                          rf"uid {NOBODY}, not by uid 0.*chown"):
        open_disk(root=root)
    assert _snapshot(root) == before


@pytest.mark.parametrize("via", ["the root itself", "a parent", "a parent of a new root"])
def test_a_root_reached_through_a_symlink_is_refused(
    open_disk: Opener, tmp_path: Path, via: str,
) -> None:
    real = tmp_path / "real"
    _with_bait(real / "disk").chmod(0o700)
    link = tmp_path / "link"
    if via == "the root itself":
        link.symlink_to(real / "disk")
        root = link
    else:
        link.symlink_to(real)
        root = link / ("disk" if via == "a parent" else "new")
    resolved = real / ("new" if via == "a parent of a new root" else "disk")
    before = _snapshot(real)
    with pytest.raises(ConfigError, match=rf"local_disk: {re.escape(str(root))} goes through "
                                          rf"the symlink {re.escape(str(link))} -> .* the real "
                                          rf"path {re.escape(str(resolved))}$"):
        open_disk(root=root)
    assert _snapshot(real) == before  # in particular, real/new was not created


def test_a_root_readable_by_others_is_used_with_a_warning_and_its_mode_kept(
    open_disk: Opener, tmp_path: Path, arena: MemoryAllocator, caplog: pytest.LogCaptureFixture,
) -> None:
    root = tmp_path / "disk"
    root.mkdir(mode=0o755)
    root.chmod(0o755)  # whatever the umask
    disk = open_disk(root=root)
    assert f"{root} can be read or entered by group or others (mode 755)" in caplog.text
    assert "chmod 700" in caplog.text
    _put(disk, make_keys(16), arena)
    assert stat.S_IMODE(root.stat().st_mode) == 0o755  # an operator's directory: not changed
    assert [stat.S_IMODE(p.stat().st_mode) for p in _files(root)] == [0o600]


def _plant_record_dir(sub: Path, kind: str, elsewhere: Path) -> tuple[Path, Path]:
    """Plant the record directory `sub` (`root/ab/cd`) as `kind`. Returns the directory a write
    through it would land in (to watch) and where a record in it really lies."""
    elsewhere.mkdir()
    if kind == "symlinked ab":
        sub.parent.symlink_to(elsewhere)
        return elsewhere, elsewhere / sub.name
    if kind == "symlinked ab/cd":
        sub.parent.mkdir()
        sub.symlink_to(elsewhere)
        return elsewhere, elsewhere
    sub.mkdir(parents=True)
    if kind == "ab/cd writable by others":
        sub.chmod(0o777)
    elif os.geteuid() == 0:
        os.chown(sub, NOBODY, -1)
    else:
        pytest.skip("chown to another user needs root")
    return sub, sub


@pytest.mark.parametrize("kind", ["symlinked ab", "symlinked ab/cd", "ab/cd of another user",
                                  "ab/cd writable by others"])
def test_a_planted_record_directory_is_never_written_read_or_deleted_through(
    open_disk: Opener, tmp_path: Path, arena: MemoryAllocator, kind: str,
) -> None:
    """Another user's `ab/cd` (say, from when the root was shared) must neither redirect a
    write nor feed a forged record to a read."""
    keys = make_keys(16)
    source = open_disk(root=tmp_path / "source")
    _put(source, keys, arena, seed=3)
    forged = source.path_for(keys[0].key).read_bytes()  # a valid record for this very key
    disk = open_disk()
    path = disk.path_for(keys[0].key)
    watched, target = _plant_record_dir(path.parent, kind, tmp_path / "elsewhere")
    before = _snapshot(watched)
    obj = make_obj(arena, SMALL_MHA, 16, 0)
    with lease([obj]):
        assert disk.batch_put(keys, [obj]) == 0
    assert disk.stats()["write_errors"] == 1 and disk.stats()["entries"] == 0
    assert _snapshot(watched) == before  # no directory, temp or record written there
    target.mkdir(exist_ok=True)
    (target / path.name).write_bytes(forged)
    before = _snapshot(watched)
    assert disk.batch_contains(keys) == 0
    assert disk.batch_get(keys) == []
    assert disk.remove(keys) == 0
    assert disk.stats()["not_regular"] == 2 and disk.stats()["entries"] == 0
    assert open_disk().stats()["entries"] == 0  # a restart does not index it either
    assert _snapshot(watched) == before  # the forged record was not deleted either
