"""The disk tier on a real filesystem: persistence across processes, crash safety, the size
cap and sharing a directory (corruption and write failures: test_disk_corruption.py; the
privacy of the tree: test_disk_privacy.py)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvtier.backends.disk.backend import SHRINK_WRITES
from kvtier.memory import MemoryAllocator, lease
from tests.backends.disk.disk_helpers import (
    _CHILD_PRELUDE,
    BIG,
    CHUNK_BYTES,
    Opener,
    _assert_hits,
    _files,
    _flip,
    _put,
    _python,
)
from tests.helpers import SMALL_MHA, make_keys, make_obj, os_thread_name, same_bytes

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


def test_touch_keeps_a_prefix_served_above_and_evicts_from_its_end(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    cap = 10 * (CHUNK_BYTES + 400)  # room for about ten records
    disk = open_disk(cap_gb=cap / 1e9)
    old, new = make_keys(16 * 4, seed=1), make_keys(16 * 4, seed=2)
    _put(disk, old, arena)
    _put(disk, new, arena)
    disk.touch(old[:2])  # a faster tier served the old prompt's prefix: no read here
    assert disk.stats()["hits"] == 0
    _put(disk, make_keys(16 * 6, seed=3), arena)  # 14 records: four must go
    assert disk.stats()["evictions"] == 4
    assert disk.batch_contains(old) == 2  # the used prefix stays, its unused suffix went first
    assert disk.batch_contains(new) == 2
    disk.check_integrity()


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
    # Leftovers of the killed writers, dated past the grace (their locks died with them), plus
    # a temp file just created by a process sharing the dir (within the grace: kept).
    (root / "00" / "00").mkdir(parents=True, exist_ok=True)
    stale = root / "00" / "00" / f"{'0' * 64}.{results[0][1]}.9.tmp"
    stale.write_bytes(b"torn")
    for left in _files(root, "*.tmp"):
        os.utime(left, (0, 0))
    live = root / "00" / "00" / f"{'1' * 64}.{os.getppid()}.9.tmp"
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


def test_a_lowered_cap_deletes_nothing_at_open_then_shrinks_least_recent_first(
    open_disk: Opener, arena: MemoryAllocator, caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 36, item 7 (a lowered cap never shrank the directory), without issue 51, item 1
    (the shrink at open deleted every other model's records)."""
    first = open_disk(cap_gb=0.01)
    prompts = [make_keys(16 * 4, seed=s) for s in range(8)]  # 32 records, oldest prompt first
    for seed, keys in enumerate(prompts):
        _put(first, keys, arena, seed=seed)
    with lease(first.batch_get(prompts[0][:2])) as got:  # the oldest prefix, used again
        assert len(got) == 2
    record = _files(first.root)[0].stat().st_size
    first.close()
    small = open_disk(cap_gb=10 * record / 1e9)  # room for ten records
    assert len(_files(small.root)) == 32 and small.stats()["evictions"] == 0
    assert "nothing is deleted now" in caplog.text
    _put(small, make_keys(16, seed=100), arena, seed=100)  # one record: evicts 4 at most
    assert small.stats()["evictions"] == SHRINK_WRITES == 4
    # Least recently used first: prompt 0's unused tail, then prompt 1's.
    assert [small.batch_contains(keys) for keys in prompts[:3]] == [2, 2, 4]
    for seed in range(101, 120):  # every write shrinks it further, down to the cap
        _put(small, make_keys(16, seed=seed), arena, seed=seed)
    files = _files(small.root)
    assert len(files) == 10 and sum(p.stat().st_size for p in files) <= small.capacity
    assert small.batch_contains(make_keys(16, seed=119)) == 1  # the newest write stays


def test_a_server_of_another_model_never_deletes_a_neighbours_records(
    open_disk: Opener, arena: MemoryAllocator,
) -> None:
    """Issue 51, item 1: two models share a directory; a third server with a tiny cap opens
    it and writes. It evicts only its own records."""
    shared = open_disk(cap_gb=0.01)
    neighbours = {m: [make_keys(16 * 4, seed=s, model=m) for s in range(4)]
                  for m in ("alpha", "beta")}
    for prompts in neighbours.values():
        for seed, keys in enumerate(prompts):
            _put(shared, keys, arena, seed=seed)
    record = _files(shared.root)[0].stat().st_size
    shared.close()
    tiny = open_disk(cap_gb=2 * record / 1e9)  # a gamma server, room for two records
    mine = [make_keys(16 * 4, seed=s, model="gamma") for s in range(4)]
    for seed, keys in enumerate(mine):
        _put(tiny, keys, arena, seed=seed)
    assert tiny.stats()["evictions"] > 0  # gamma's own records made room for gamma's
    assert len(_files(tiny.root)) <= 32 + 2
    tiny.close()
    reader = open_disk(cap_gb=0.01)  # a fresh alpha/beta reader loads all of its prompts
    for prompts in neighbours.values():
        assert [reader.batch_contains(keys) for keys in prompts] == [4, 4, 4, 4]


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


def test_read_ahead_threads_show_their_names_to_the_os(open_disk: Opener) -> None:
    disk = open_disk()
    assert disk._pool().submit(os_thread_name).result(timeout=30) == "kv-disk_0"
