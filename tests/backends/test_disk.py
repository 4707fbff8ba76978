"""The disk tier on a real filesystem: persistence across processes, crash safety, corruption,
the size cap, sharing a directory, and write failures."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvtier.backends import BackendContext
from kvtier.backends.disk import DiskBackend
from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease
from tests.helpers import (
    SMALL_MHA,
    SMALL_MLA,
    make_keys,
    make_obj,
    os_thread_name,
    put_random,
    same_bytes,
)

REPO = Path(__file__).resolve().parents[2]
CHUNK = 16
CHUNK_BYTES = SMALL_MHA.nbytes(CHUNK)  # 2 KiB of payload per full chunk
BIG = KVLayout.mha(32, 8, 128, torch.bfloat16)  # Llama-3-8B: 128 KiB a token

Opener = Callable[..., DiskBackend]


@pytest.fixture
def arena() -> Iterator[MemoryAllocator]:
    """The engine's arena, shared by every tier a test opens."""
    alloc = MemoryAllocator(16 << 20)
    yield alloc
    assert alloc.used_bytes == 0, "the disk tier leaked arena memory"
    alloc.check_integrity()


@pytest.fixture
def open_disk(tmp_path: Path, arena: MemoryAllocator) -> Iterator[Opener]:
    """Opens disk tiers (default: on `tmp_path/disk`); checks and closes them at the end."""
    opened: list[DiskBackend] = []

    def _open(layout: KVLayout = SMALL_MHA, cap_gb: float = 0.01,
              root: Path | None = None) -> DiskBackend:
        config = Config(chunk_size=CHUNK, max_local_cpu_size=0.016, max_local_disk_size=cap_gb,
                        local_disk=str(root or tmp_path / "disk"))
        backend = DiskBackend(BackendContext(config=config, layout=layout, allocator=arena))
        opened.append(backend)
        return backend

    yield _open
    for backend in opened:
        backend.check_integrity()
        backend.close()


def _put(disk: DiskBackend, keys: list[ChunkKey], arena: MemoryAllocator, seed: int = 0,
         layout: KVLayout = SMALL_MHA) -> list[torch.Tensor]:
    return put_random(disk.batch_put, arena, layout, keys, seed)


def _assert_hits(disk: DiskBackend, keys: list[ChunkKey], want: list[torch.Tensor]) -> None:
    with lease(disk.batch_get(keys)) as got:
        assert len(got) == len(keys)
        for obj, expected in zip(got, want, strict=True):
            assert same_bytes(obj.tensor, expected)


def _files(root: Path, pattern: str = "*.kvt") -> list[Path]:
    return sorted(root.glob(f"*/*/{pattern}"))


def _python(code: str) -> subprocess.Popen[str]:
    """Start a Python process running `code` with the repo importable."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


_CHILD_PRELUDE = """
    import sys
    from kvtier.backends import BackendContext
    from kvtier.backends.disk import DiskBackend
    from kvtier.config import Config
    from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease
    from tests.helpers import SMALL_MHA, make_keys, make_obj
    import torch
    def open_disk(root, layout=SMALL_MHA):
        config = Config(chunk_size=16, max_local_cpu_size=0.016, max_local_disk_size=1.0,
                        local_disk=root)
        alloc = MemoryAllocator(int(config.max_local_cpu_size * 1e9))
        return DiskBackend(BackendContext(config=config, layout=layout, allocator=alloc)), alloc
"""


# --- persistence and sharing -------------------------------------------------------------------


def test_store_close_then_another_process_reads_byte_exact(
    open_disk: Opener, tmp_path: Path, arena: MemoryAllocator,
) -> None:
    disk = open_disk()
    keys = make_keys(16 * 5 + 7)
    _put(disk, keys, arena, seed=100)
    disk.close()
    child = _python(_CHILD_PRELUDE + f"""
    disk, alloc = open_disk({str(tmp_path / "disk")!r})
    keys = make_keys(16 * 5 + 7)
    with lease(disk.batch_get(keys)) as got:
        assert len(got) == len(keys), len(got)
        for i, (obj, key) in enumerate(zip(got, keys)):
            want = make_obj(alloc, SMALL_MHA, key.num_tokens, 100 + i)
            assert torch.equal(obj.tensor.view(torch.uint8), want.tensor.view(torch.uint8)), i
            want.release()
    assert disk.stats()["entries"] == len(keys)
    print("ok")
    """)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.strip() == "ok"


def test_second_process_sees_new_records_without_restart(
    open_disk: Opener, tmp_path: Path, arena: MemoryAllocator,
) -> None:
    reader = open_disk()
    first, second = make_keys(48, seed=1), make_keys(48, seed=2)
    assert reader.batch_contains(first) == 0 and reader.batch_get(second) == []
    child = _python(_CHILD_PRELUDE + f"""
    disk, alloc = open_disk({str(tmp_path / "disk")!r})
    for seed in (1, 2):
        keys = make_keys(48, seed=seed)
        objs = [make_obj(alloc, SMALL_MHA, k.num_tokens, 7 + i) for i, k in enumerate(keys)]
        with lease(objs):
            assert disk.batch_put(keys, objs) == 3
    """)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert reader.first_held([make_keys(48, seed=9)[0], first[2]]) == 1  # adopted by a tail probe
    assert reader.batch_contains(first) == 3
    want = [make_obj(arena, SMALL_MHA, k.num_tokens, 7 + i) for i, k in enumerate(second)]
    with lease(want):
        _assert_hits(reader, second, [w.tensor for w in want])  # found by get alone
    assert reader.stats()["entries"] == 6


def test_restart_keeps_recency_so_eviction_takes_suffixes(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    cap = 10 * (CHUNK_BYTES + 400)  # room for about ten records
    disk = open_disk(cap_gb=cap / 1e9)
    old, new = make_keys(16 * 4, seed=1), make_keys(16 * 4, seed=2)
    _put(disk, old, arena)
    _put(disk, new, arena)
    with lease(disk.batch_get(old[:2])):  # the old prompt's prefix is now the newest
        pass
    disk.close()
    disk = open_disk(cap_gb=cap / 1e9)
    _put(disk, make_keys(16 * 6, seed=3), arena)  # 14 records: four must go
    assert disk.stats()["evictions"] == 4
    assert disk.batch_contains(old) == 2  # the used prefix stays, its unused suffix went first
    assert disk.batch_contains(new) == 2  # then the deepest chunks of the next oldest prompt


def test_large_records_round_trip_and_verify(open_disk: Opener, arena: MemoryAllocator) -> None:
    """4 MiB records: multi-page payloads, written and read without intermediate copies."""
    keys = make_keys(64, chunk_size=32, layout=BIG)
    disk = open_disk(layout=BIG, cap_gb=0.1)
    want = _put(disk, keys, arena, seed=3, layout=BIG)
    _assert_hits(disk, keys, want)
    disk.close()
    disk = open_disk(layout=BIG, cap_gb=0.1)
    _assert_hits(disk, keys, want)
    _flip(disk.path_for(keys[1].key), -(1 << 20))
    with lease(disk.batch_get(keys)) as got:
        assert len(got) == 1
    assert disk.stats()["corrupt"] == 1


# --- crash safety ------------------------------------------------------------------------------

ROUNDS = 3


def _write_until_killed(root: Path, rnd: int) -> tuple[int, int]:
    """A child writes prompt `rnd` chunk by chunk, as fast as it can, printing each
    acknowledged index; it is SIGKILLed a little after its 8th ack (the delay varies per round
    so the kill lands at different points of a write). Returns (last ack, child pid)."""
    child = _python(_CHILD_PRELUDE + f"""
    BIG = KVLayout.mha(32, 8, 128, torch.bfloat16)
    disk, alloc = open_disk({str(root)!r}, layout=BIG)
    objs = [make_obj(alloc, BIG, 16, seed) for seed in (0, 1)]
    for i, key in enumerate(make_keys(16 * 400, layout=BIG, seed={rnd})):
        assert disk.batch_put([key], [objs[i % 2]]) == 1
        print(i, flush=True)
    """)
    acked = -1
    assert child.stdout is not None
    for line in child.stdout:
        acked = int(line)
        if acked >= 8:
            time.sleep(0.0003 * rnd)
            break
    child.send_signal(signal.SIGKILL)
    _, err = child.communicate(timeout=60)
    assert acked >= 8, err
    return acked, child.pid


def test_sigkill_mid_writes_never_serves_a_torn_record(
    tmp_path: Path, open_disk: Opener, arena: MemoryAllocator,
) -> None:
    root = tmp_path / "disk"
    results = [_write_until_killed(root, rnd) for rnd in range(ROUNDS)]
    # Leftovers of a dead writer, plus an in-flight temp file of a live process sharing the dir.
    (root / "00" / "00").mkdir(parents=True, exist_ok=True)
    stale = root / "00" / "00" / f"{'0' * 64}.{results[0][1]}.9.tmp"
    live = root / "00" / "00" / f"{'1' * 64}.{os.getppid()}.9.tmp"
    stale.write_bytes(b"torn")
    live.write_bytes(b"in flight")

    disk = open_disk(layout=BIG, cap_gb=1.0)
    assert not stale.exists() and live.exists()
    assert _files(root, "*.tmp") == [live]
    want = [make_obj(arena, BIG, 16, seed) for seed in (0, 1)]
    with lease(want):
        for rnd, (acked, _) in enumerate(results):
            keys = make_keys(16 * (acked + 4), layout=BIG, seed=rnd)
            for i, key in enumerate(keys):
                with lease(disk.batch_get([key])) as got:
                    assert i > acked or len(got) == 1, f"acknowledged chunk {rnd}/{i} lost"
                    assert not got or same_bytes(got[0].tensor, want[i % 2].tensor), \
                        f"chunk {rnd}/{i} served torn"
    assert disk.stats()["corrupt"] == 0  # temp + rename: no torn file ever had a final name


# --- corruption --------------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


CORRUPTIONS: dict[str, Callable[[Path, Path], None]] = {
    "payload_byte": lambda p, other: _flip(p, -5),
    "header_byte": lambda p, other: _flip(p, 30),
    "key_byte": lambda p, other: _flip(p, 90),
    "truncated": lambda p, other: p.write_bytes(p.read_bytes()[:-1]),
    "truncated_header": lambda p, other: p.write_bytes(p.read_bytes()[:40]),
    "zero_length": lambda p, other: p.write_bytes(b""),
    "trailing_bytes": lambda p, other: p.write_bytes(p.read_bytes() + b"\0"),
    "foreign_key": lambda p, other: shutil.copyfile(other, p),
}


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_corrupt_record_is_a_counted_miss_and_deleted(
    open_disk: Opener, damage: str, arena: MemoryAllocator,
) -> None:
    disk = open_disk()
    keys = make_keys(48)
    want = _put(disk, keys, arena)
    victim = disk.path_for(keys[1].key)
    CORRUPTIONS[damage](victim, disk.path_for(keys[2].key))
    with lease(disk.batch_get(keys)) as got:
        assert len(got) == 1 and same_bytes(got[0].tensor, want[0])
    assert not victim.exists()
    stats = disk.stats()
    assert stats["corrupt"] == 1 and stats["entries"] == 2
    assert disk.batch_contains(keys) == 1
    _assert_hits(disk, keys[2:], want[2:])  # neighbours untouched


def _plant(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
@pytest.mark.parametrize("indexed", [True, False])
def test_non_regular_file_at_a_record_path_is_a_counted_miss(
    open_disk: Opener, arena: MemoryAllocator, kind: str, indexed: bool,
) -> None:
    disk = open_disk()
    keys = make_keys(48)
    want = _put(disk, keys, arena)
    victim = disk.path_for(keys[1].key)
    if indexed:  # replaced behind the tier's back
        victim.unlink()
    else:  # another process sharing the directory: never indexed here
        disk.remove(keys[1:])
    _plant(victim, kind)
    got: list[list[MemoryObj]] = []
    reader = threading.Thread(target=lambda: got.append(disk.batch_get(keys)), daemon=True)
    reader.start()
    reader.join(60)  # a hang guard, not a timing: before the fix a FIFO blocked forever
    if reader.is_alive():
        os.close(os.open(victim, os.O_WRONLY | os.O_NONBLOCK))  # release the blocked open
        pytest.fail(f"batch_get blocked on a {kind} at a record path")
    with lease(got[0]) as objs:
        assert len(objs) == 1 and same_bytes(objs[0].tensor, want[0])
    assert disk.batch_contains(keys) == 1
    assert disk.first_held(keys[1:2]) == -1
    assert disk.stats()["not_regular"] >= 1
    assert victim.exists() or victim.is_symlink()  # not ours: left in place
    # A restart does not index it either.
    assert open_disk().stats()["entries"] == (2 if indexed else 1)


def test_wrong_layout_record_is_a_counted_miss_and_deleted(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    keys = make_keys(32)
    _put(open_disk(), keys, arena)
    # An engine with another layout asking for these key strings (e.g. a fingerprint bug).
    other = open_disk(layout=SMALL_MLA)
    assert other.batch_get(keys) == []
    assert other.stats()["corrupt"] == 1
    assert not other.path_for(keys[0].key).exists()
    assert other.path_for(keys[1].key).exists()


def test_files_removed_behind_the_tiers_back_are_misses(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    disk = open_disk()
    keys = make_keys(48)
    _put(disk, keys, arena)
    shutil.rmtree(disk.root)
    assert disk.batch_get(keys) == []
    assert disk.stats()["vanished"] == 1
    assert disk.remove(keys) == 0
    want = _put(disk, keys, arena, seed=5)  # the tree is recreated on demand
    _assert_hits(disk, keys, want)


# --- the size cap ------------------------------------------------------------------------------


def test_cap_holds_under_a_stream_three_times_the_cap_and_prefixes_stay_usable(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    cap = 40 * (CHUNK_BYTES + 300)
    disk = open_disk(cap_gb=cap / 1e9)
    prompts = [make_keys(16 * 6, seed=s) for s in range(20)]  # 120 chunks: 3x the cap
    for seed, keys in enumerate(prompts):
        _put(disk, keys, arena, seed=seed * 10)
        on_disk = sum(p.stat().st_size for p in _files(disk.root))
        assert on_disk <= cap
        assert disk.stats()["bytes"] == on_disk
        if seed % 4 == 3:  # keep reusing the prefix of the first prompt
            with lease(disk.batch_get(prompts[0][:2])) as got:
                assert len(got) == 2
    assert disk.stats()["evictions"] >= 60
    for keys in prompts:
        present = [disk.path_for(k.key).exists() for k in keys]
        held = disk.batch_contains(keys)
        assert present == [True] * held + [False] * (len(keys) - held), "a hole in a prefix"
    assert disk.batch_contains(prompts[0]) >= 2
    assert disk.batch_contains(prompts[-1]) == 6


def test_a_second_instance_with_a_smaller_cap_deletes_nothing(
    open_disk: Opener, arena: MemoryAllocator, caplog: pytest.LogCaptureFixture,
) -> None:
    first = open_disk(cap_gb=0.01)
    prompts = [make_keys(16 * 4, seed=s) for s in range(8)]  # 32 records
    for seed, keys in enumerate(prompts):
        _put(first, keys, arena, seed=seed)
    before = _files(first.root)
    assert len(before) == 32
    small = open_disk(cap_gb=2 * (CHUNK_BYTES + 300) / 1e9)  # room for two records
    assert _files(first.root) == before  # opening it deleted nothing ...
    assert "nothing was deleted" in caplog.text
    assert small.stats()["evictions"] == 0
    _put(small, make_keys(16, seed=99), arena, seed=99)  # ... and a write evicts one record
    assert len(_files(first.root)) == 32 and small.stats()["evictions"] == 1
    assert all(first.batch_contains(keys) >= 1 for keys in prompts[1:])


def test_record_larger_than_the_cap_is_dropped_and_counted(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    disk = open_disk(cap_gb=CHUNK_BYTES / 2 / 1e9)
    keys = make_keys(16)
    obj = make_obj(arena, SMALL_MHA, 16, 0)
    with lease([obj]):
        assert disk.batch_put(keys, [obj]) == 0
    assert disk.stats()["write_dropped"] == 1
    assert _files(disk.root, "*") == []


def test_concurrent_readers_writers_and_eviction(open_disk: Opener, arena: MemoryAllocator) -> None:
    disk = open_disk(cap_gb=12 * (CHUNK_BYTES + 300) / 1e9)
    prompts = [make_keys(16 * 3, seed=s) for s in range(8)]
    errors: list[BaseException] = []

    def writer(idx: int) -> None:
        try:
            for _ in range(6):
                for j in range(idx, len(prompts), 2):
                    _put(disk, prompts[j], arena, seed=j * 10)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(40):
                for j, keys in enumerate(prompts):
                    with lease(disk.batch_get(keys)) as got:
                        for i, obj in enumerate(got):
                            want = make_obj(arena, SMALL_MHA, 16, j * 10 + i)
                            with lease([want]):
                                assert same_bytes(obj.tensor, want.tensor)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    disk.check_integrity()
    assert sum(p.stat().st_size for p in _files(disk.root)) <= disk.capacity


# --- failures ----------------------------------------------------------------------------------


def test_unusable_directory_is_a_config_error_naming_the_path(
    open_disk: Opener, tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for root in (blocker, blocker / "disk"):
        with pytest.raises(ConfigError, match=str(root)):
            open_disk(root=root)


def test_write_errors_are_dropped_counted_and_serving_goes_on(tmp_path: Path) -> None:
    """A file-size limit makes writes fail with EFBIG, like a full disk fails with ENOSPC."""
    child = _python(_CHILD_PRELUDE + f"""
    import os, resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    disk, alloc = open_disk({str(tmp_path / "disk")!r})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))  # below one 2 KiB record
    keys = make_keys(32)
    objs = [make_obj(alloc, SMALL_MHA, 16, i) for i in range(2)]
    with lease(objs):
        assert disk.batch_put(keys, objs) == 0  # the second chunk would be unreachable
        stats = disk.stats()
        assert stats["write_errors"] == 1 and stats["entries"] == 0, stats
        assert [f for _, _, fs in os.walk(disk.root) for f in fs] == []  # no temp left
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert disk.batch_put(keys, objs) == 2
    assert len(disk.batch_get(keys)) == 2
    print("ok")
    """)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.strip() == "ok"


def test_put_rejects_mismatched_objects_before_writing(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    disk = open_disk()
    keys = make_keys(32)
    obj = make_obj(arena, SMALL_MHA, 8, 0)
    with lease([obj]):
        with pytest.raises(ValueError, match="objs"):
            disk.batch_put(keys[:1], [obj])
        with pytest.raises(ValueError, match="length"):
            disk.batch_put(keys, [obj])
    assert _files(disk.root, "*") == []


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
    os.utime(stale, (0, 0))  # older than STALE_TMP_SECS: garbage to a tier that opens
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
    assert "kvtier disk" not in caplog.text  # nothing to warn about
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


def test_read_ahead_threads_show_their_names_to_the_os(open_disk: Opener) -> None:
    disk = open_disk()
    assert disk._pool().submit(os_thread_name).result(timeout=30) == "kv-disk_0"
