"""What a tier watcher is told: every chunk a store puts in the CPU tier, a lower tier's
writer writes or a read promotes, and every chunk the CPU tier evicts; a failing watcher fails
nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.storage import StorageManager
from tests.helpers import SMALL_MHA, make_keys, put_random

CHUNK = 16


class Seen:
    """A watcher: what each tier holds now, as it was told."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = {}
        self.calls: list[tuple[str, list[str], bool]] = []
        self._lock = threading.Lock()  # writers call from their own threads

    def stored(self, tier: str, keys: Sequence[ChunkKey]) -> None:
        self._told(tier, [k.key for k in keys], True)

    def removed(self, tier: str, keys: Sequence[str]) -> None:
        self._told(tier, list(keys), False)

    def _told(self, tier: str, keys: list[str], held: bool) -> None:
        with self._lock:
            self.calls.append((tier, keys, held))
            have = self.held.setdefault(tier, set())
            for key in keys:
                (have.add if held else have.discard)(key)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[StorageManager]:
    # room for 4 chunks of 16 tokens in the CPU tier (4096 bytes each)
    sm = StorageManager(Config(chunk_size=CHUNK, max_local_cpu_size=4 * 4096 / 1e9,
                               local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1),
                        SMALL_MHA)
    yield sm
    sm.close()


def _held(sm: StorageManager, tier: str, keys: Sequence[ChunkKey]) -> set[str]:
    backend = next(t for t in sm.tiers if t.name == tier)
    return {k.key for k in keys if backend.batch_contains([k]) == 1}


def test_the_watcher_sees_what_each_tier_holds(manager: StorageManager) -> None:
    seen = Seen()
    manager.watch.add(seen)
    first, second = make_keys(64, seed=1), make_keys(64, seed=2)
    put_random(manager.put, manager.allocator, SMALL_MHA, first)
    assert manager.flush()
    assert seen.held["cpu"] == {k.key for k in first}
    assert seen.held["disk"] == {k.key for k in first} == _held(manager, "disk", first)
    # The second prompt evicts the first from the CPU tier (room for 4 chunks): each
    # eviction is told, and the watcher's view is the tier's.
    put_random(manager.put, manager.allocator, SMALL_MHA, second)
    assert manager.flush()
    assert seen.held["cpu"] == _held(manager, "cpu", first + second)
    assert any(not held for tier, _, held in seen.calls if tier == "cpu")
    # A read of the first prompt promotes it from disk: the CPU tier holds it again.
    with manager.get(first) as objs:
        assert len(objs) == 4
    assert seen.held["cpu"] == _held(manager, "cpu", first + second)
    assert {k.key for k in first} <= seen.held["cpu"]
    # Prefix order, as the chain runs: a store names its chunks first to last.
    stores = [keys for tier, keys, held in seen.calls if tier == "cpu" and held]
    assert stores[0] == [k.key for k in first]


def test_a_failing_watcher_fails_no_store(manager: StorageManager) -> None:
    class Broken(Seen):
        def stored(self, tier: str, keys: Sequence[ChunkKey]) -> None:
            raise RuntimeError("watcher bug")

    seen = Seen()
    manager.watch.add(Broken())
    manager.watch.add(seen)  # the next watcher is still told
    keys = make_keys(32, seed=3)
    put_random(manager.put, manager.allocator, SMALL_MHA, keys)
    assert manager.flush()
    assert manager.contains(keys) == 2
    assert seen.held["disk"] == {k.key for k in keys}


def test_nobody_watching_is_the_default(manager: StorageManager) -> None:
    keys = make_keys(32, seed=4)
    put_random(manager.put, manager.allocator, SMALL_MHA, keys)
    assert manager.flush() and manager.contains(keys) == 2
    assert manager.watch._watchers == ()


def test_a_removal_is_told_for_every_tier(manager: StorageManager) -> None:
    seen = Seen()
    manager.watch.add(seen)
    keys = make_keys(64, seed=5)
    put_random(manager.put, manager.allocator, SMALL_MHA, keys)
    assert manager.flush()
    manager.remove(keys[2:])  # what verification's purge and a tenant's purge do
    assert seen.held["cpu"] == seen.held["disk"] == {k.key for k in keys[:2]}
    assert seen.held["disk"] == _held(manager, "disk", keys)


def test_the_disk_tiers_own_evictions_are_told(tmp_path: Path) -> None:
    """The disk tier evicts on its own, under its cap: the watcher's view of it stays the
    tier's (what a router is told: BlockRemoved(DISK))."""
    record = 4096 + 512  # a chunk and its header, about
    sm = StorageManager(Config(chunk_size=CHUNK, max_local_cpu_size=4 * 4096 / 1e9,
                               local_disk=str(tmp_path / "disk"),
                               max_local_disk_size=6 * record / 1e9), SMALL_MHA)
    try:
        seen = Seen()
        sm.watch.add(seen)
        prompts = [make_keys(64, seed=10 + i) for i in range(4)]
        for keys in prompts:
            put_random(sm.put, sm.allocator, SMALL_MHA, keys)
            assert sm.flush()
        every = [k for keys in prompts for k in keys]
        on_disk = _held(sm, "disk", every)
        assert 0 < len(on_disk) < len(every)  # the cap made it evict
        assert seen.held["disk"] == on_disk
        assert any(not held for tier, _, held in seen.calls if tier == "disk")
    finally:
        sm.close()


def test_nobody_watching_the_disk_tier_notes_nothing(tmp_path: Path) -> None:
    from kvtier.backends.disk.evictions import EvictionNotes
    from kvtier.storage.watch import TierWatch

    notes = EvictionNotes("disk", limit=2)
    notes.wrote("a", "key-a")  # no watch at all
    watch = TierWatch()
    notes.watch = watch
    notes.wrote("b", "key-b")  # a watch nobody listens to
    assert notes.forget(["a", "b"]) == []
    seen = Seen()
    watch.add(seen)
    for name in "cde":
        notes.wrote(name, f"key-{name}")
    notes.evicted(["c", "d", "e"])  # "c" was the oldest note of 2: forgotten, not told
    assert seen.calls == [("disk", ["key-d", "key-e"], False)]
