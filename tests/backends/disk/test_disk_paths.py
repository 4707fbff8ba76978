"""Issue 36, item 7: what the disk tier may use as its root, and what under it is its own. A
root that is the filesystem root, a home or system directory (or holds a home) is refused
naming `local_disk`; only files named as records (`ab/cd/<64 hex>.kvt`, in their own `ab/cd`)
and its temp files are ever indexed, evicted or deleted. (A root through a symlink:
test_disk_privacy.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.backends.disk import files as rf
from kvtier.backends.disk import paths
from kvtier.errors import ConfigError
from kvtier.memory import MemoryAllocator
from tests.backends.disk.disk_helpers import Opener, _files, _put
from tests.helpers import make_keys

OTHER = "ab" * 32  # a record name that belongs in ab/ab/


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory of this test's own ($HOME)."""
    path = tmp_path / "users" / "me"
    path.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(path))
    return path


@pytest.mark.parametrize("where, why", [
    (lambda home: Path("/"), "is the filesystem root"),
    (lambda home: home, "is the home directory"),
    (lambda home: home.parent, "holds the home directory"),
    (lambda home: Path(f"{home}/../me/."), "is the home directory"),
    (lambda home: Path("/usr"), "is a system directory"),
    (lambda home: Path("/etc"), "is a system directory"),
])
def test_a_dangerous_root_is_a_config_error_naming_local_disk(
    open_disk: Opener, home: Path, where, why: str,  # noqa: ANN001
) -> None:
    root = where(home)
    before = sorted(os.listdir(root))
    with pytest.raises(ConfigError, match=rf"^local_disk: .* {why}"):
        open_disk(root=root)
    assert sorted(os.listdir(root)) == before  # nothing created there, not even a probe


def test_a_directory_of_its_own_below_home_or_a_system_directory_is_fine(
    open_disk: Opener, home: Path, arena: MemoryAllocator,
) -> None:
    disk = open_disk(root=home / ".cache" / "kvtier")
    _put(disk, make_keys(16, seed=1), arena)
    assert len(_files(disk.root)) == 1
    assert paths.root_problem(Path("/var/cache/kvtier")) is None
    assert paths.root_problem(Path("/srv/kv")) is None


def _plant_foreign(root: Path) -> dict[Path, bytes]:
    """Files under `root` that look a little like the tier's but are not named as its own."""
    stale_pid = 4_000_000  # above pid_max: dead
    planted = {
        root / "ab" / "ab" / "notes.kvt": b"mine",
        root / "ab" / "ab" / "abab-notes.kvt": b"in the directory its name names",
        root / "ab" / "ab" / f"{OTHER}.kvt.bak": b"backup",
        root / "ab" / "ab" / f"{OTHER.upper()}.kvt": b"upper case",
        root / "cd" / "ef" / f"{OTHER}.kvt": b"a record name in another record's directory",
        root / "ab" / "ab" / f"notes.{stale_pid}.1.tmp": b"a temp-looking file",
        root / "ab" / "ab" / f"{OTHER}.{stale_pid}.x.tmp": b"not a sequence number",
        root / "ab" / "ab" / "zz" / f"{OTHER}.kvt": b"one level too deep",
        root / "readme.kvt": b"at the top",
    }
    for path, data in planted.items():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_bytes(data)
    return planted


def test_files_not_named_as_records_are_never_indexed_evicted_or_deleted(
    open_disk: Opener, tmp_path: Path, arena: MemoryAllocator,
) -> None:
    root = tmp_path / "disk"
    first = open_disk(root=root)
    keys = make_keys(16 * 4, seed=3)
    _put(first, keys, arena)
    first.close()
    record = _files(root)[0].stat().st_size
    planted = _plant_foreign(root)
    stale = rf.record_path(root, OTHER).with_suffix(".4000000.7.tmp")
    stale.write_bytes(b"a stale temp file of ours")
    os.utime(stale, (0, 0))  # unlocked, past the grace: a dead writer's
    tiny = open_disk(root=root, cap_gb=record / 1e9)  # opened over its cap: deletes nothing
    assert tiny.stats()["entries"] == 4 and tiny.stats()["evictions"] == 0
    _put(tiny, make_keys(16, seed=9), arena)  # a write shrinks it: evicts all it may
    assert tiny.stats()["entries"] == 1 and tiny.stats()["evictions"] == 4
    assert not any(tiny.path_for(k.key).exists() for k in keys)  # the records are gone ...
    assert not stale.exists()  # ... and the stale temp file of ours
    for path, data in planted.items():  # ... nothing else
        assert path.read_bytes() == data, path


def test_record_and_temp_names() -> None:
    assert paths.record_stem(f"{OTHER}.kvt", "ab", "ab") == OTHER
    assert paths.record_stem(f"{OTHER}.kvt", "ab", "cd") is None
    assert paths.record_stem(f"{OTHER[:-1]}.kvt", "ab", "ab") is None
    assert paths.is_temp_name(f"{OTHER}.12.3.tmp", "ab", "ab")
    assert not paths.is_temp_name(f"{OTHER}.12.3.tmp", "cd", "ab")
    assert not paths.is_temp_name("x.12.3.tmp", "ab", "ab")


def test_unlink_record_never_follows_a_symlink(tmp_path: Path) -> None:
    root, outside = tmp_path / "disk", tmp_path / "outside"
    (root / "ab").mkdir(parents=True)
    outside.mkdir()
    (outside / f"{OTHER}.kvt").write_bytes(b"precious")
    (root / "ab" / "ab").symlink_to(outside)  # a symlinked ab/cd
    assert not paths.unlink_record(root, f"{OTHER}.kvt")
    (root / "ab" / "ab").unlink()
    (root / "ab" / "ab").mkdir()
    (root / "ab" / "ab" / f"{OTHER}.kvt").symlink_to(outside / f"{OTHER}.kvt")  # a symlink
    assert not paths.unlink_record(root, f"{OTHER}.kvt")
    assert (outside / f"{OTHER}.kvt").read_bytes() == b"precious"
    (root / "ab" / "ab" / f"{OTHER}.kvt").unlink()
    (root / "ab" / "ab" / f"{OTHER}.kvt").write_bytes(b"a record")
    assert not paths.unlink_record(root, "notes.kvt")  # not a record name: never
    assert paths.unlink_record(root, f"{OTHER}.kvt")
    assert not (root / "ab" / "ab" / f"{OTHER}.kvt").exists()
    assert not paths.unlink_record(root, f"{OTHER}.kvt")  # gone
