"""Which in-flight files of a shared disk directory (record temp files, probe files) a tier may
delete: only those whose writer is gone, told by a lock the writer holds, never by the pid in
the name (a server in another PID namespace has pids that look dead here, or are someone
else's). Names that do not parse, and things that are not files, are left and never raise;
nothing another process made is ever unlinked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.backends.disk.probe import scratch_files
from kvtier.memory import MemoryAllocator
from tests.backends.disk.disk_helpers import Opener, _files, _put
from tests.helpers import make_keys

LOOKS_DEAD = 4_194_305  # past PID_MAX_LIMIT (2^22): no process here has it
PAST_C_LONG = "9" * 25
STEM = "abab" + "0" * 60  # a record name in ab/ab
OLD = time.time() - 2 * 3600  # older than any grace: garbage unless its writer lives

_HOLDER = """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"in flight")
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.utime(sys.argv[1], (float(sys.argv[2]), float(sys.argv[2])))
    print("locked", flush=True)
    sys.stdin.read()  # until the test lets go
"""

Holder = Callable[[Path], subprocess.Popen[str]]


@pytest.fixture
def live_writer() -> Iterator[Holder]:
    """`hold(path)`: another process creates `path`, dated hours ago, and holds its lock (as a
    writer in another PID namespace would) until its stdin closes."""
    started: list[subprocess.Popen[str]] = []

    def hold(path: Path) -> subprocess.Popen[str]:
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HOLDER), str(path),
                                  str(OLD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        started.append(child)
        assert child.stdout is not None and child.stdout.readline() == "locked\n"
        return child

    yield hold
    for child in started:
        child.kill()
        child.wait()


def _let_go(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.close()
    assert child.wait(timeout=30) == 0


def _plant(path: Path, data: bytes = b"left over") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(data)
    os.utime(path, (OLD, OLD))
    return path


def test_a_live_writers_temp_file_is_kept_whatever_its_pid(
        open_disk: Opener, tmp_path: Path, live_writer: Holder) -> None:
    root = tmp_path / "disk"
    open_disk(root=root)
    busy = root / "ab" / "ab" / f"{STEM}.{LOOKS_DEAD}.0.tmp"
    busy.parent.mkdir(parents=True, mode=0o700)
    writer = live_writer(busy)
    open_disk(root=root)  # its start-up scan removes stale temp files
    assert busy.exists()
    _let_go(writer)  # the writer died without renaming it: garbage now
    open_disk(root=root)
    assert not busy.exists()


def test_a_live_writers_probe_file_is_kept_whatever_its_pid(
        open_disk: Opener, live_writer: Holder) -> None:
    disk = open_disk()
    busy = disk.root / f".kvtier-probe.{LOOKS_DEAD}.0.tmp"
    writer = live_writer(busy)
    assert disk.probe(4096)[0].read_bytes == 4096
    assert busy.exists()
    _let_go(writer)
    assert disk.probe(4096)[0].read_bytes == 4096
    assert scratch_files(disk.root) == []


def test_a_write_in_flight_is_never_taken_by_another_tiers_clean_up(
        open_disk: Opener, arena: MemoryAllocator, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = open_disk()
    replace, seen = os.replace, []

    def open_another_tier_first(src: str, dst: str) -> None:
        if str(src).endswith(".tmp") and not seen:
            seen.append(src)
            os.utime(src, (OLD, OLD))  # however long the write took ...
            open_disk(root=disk.root)  # ... a neighbour's start-up scan leaves it
        replace(src, dst)

    monkeypatch.setattr(os, "replace", open_another_tier_first)
    keys = make_keys(16)
    _put(disk, keys, arena)
    assert seen and disk.batch_contains(keys) == 1 and disk.stats()["write_errors"] == 0


def test_names_that_do_not_parse_never_stop_a_tier_and_are_never_misjudged(
        open_disk: Opener, tmp_path: Path) -> None:
    root = tmp_path / "disk"
    open_disk(root=root)
    garbage = [_plant(root / "ab" / "ab" / f"{STEM}.{PAST_C_LONG}.0.tmp"),
               _plant(root / f".kvtier-probe.{PAST_C_LONG}.0.tmp")]
    not_ours = _plant(root / "ab" / "ab" / f"{STEM}.\u00b2\u00b3.0.tmp")  # digits, not ASCII
    disk = open_disk(root=root)  # raised OverflowError: the server did not start
    assert disk.probe(4096)[0].read_bytes == 4096
    assert not any(p.exists() for p in garbage)  # unlocked for hours: a dead writer's
    assert not_ours.exists()


def test_a_directory_at_an_in_flight_name_disables_nothing(
        open_disk: Opener, tmp_path: Path) -> None:
    root = tmp_path / "disk"
    open_disk(root=root)
    dirs = [root / f".kvtier-probe.{LOOKS_DEAD}.0.tmp", root / "ab" / "ab" / f"{STEM}.1.2.tmp"]
    for path in dirs:
        path.mkdir(parents=True, mode=0o700)
        os.utime(path, (OLD, OLD))
    disk = open_disk(root=root)
    for _ in range(2):  # every later probe too
        assert disk.probe(4096)[0].read_bytes == 4096
    assert all(path.is_dir() for path in dirs)


def test_a_probe_never_unlinks_a_file_it_did_not_create(
        open_disk: Opener, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = open_disk()
    real_open, theirs = os.open, []

    def another_process_was_first(path: str | os.PathLike[str], flags: int, *args: int,
                                  **kwargs: int) -> int:
        if ".kvtier-probe." in str(path) and flags & os.O_EXCL and not theirs:
            theirs.append(Path(path))
            Path(path).write_bytes(b"another process's probe")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", another_process_was_first)
    with pytest.raises(FileExistsError):
        disk.probe(4096)
    monkeypatch.undo()
    assert theirs and theirs[0].read_bytes() == b"another process's probe"


def test_opening_a_root_never_unlinks_a_check_file_of_a_server_with_the_same_pid(
        open_disk: Opener, tmp_path: Path) -> None:
    root = tmp_path / "disk"
    open_disk(root=root)
    theirs = root / f".probe.{os.getpid()}.tmp"  # another PID namespace's server, mid-check
    theirs.write_bytes(b"")
    open_disk(root=root)
    assert theirs.exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".probe.")] == [theirs.name]


def test_a_dead_writers_temp_file_is_kept_for_the_grace_then_removed(
        open_disk: Opener, tmp_path: Path) -> None:
    root = tmp_path / "disk"
    open_disk(root=root)
    fresh = root / "ab" / "ab" / f"{STEM}.{LOOKS_DEAD}.1.tmp"
    fresh.parent.mkdir(parents=True, mode=0o700)
    fresh.write_bytes(b"just created, not locked yet (or by an older kvtier)")
    open_disk(root=root)
    assert fresh.exists()
    os.utime(fresh, (OLD, OLD))
    open_disk(root=root)
    assert not fresh.exists()
    assert _files(root, "*.tmp") == []
