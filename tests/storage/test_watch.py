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

    def __call__(self, tier: str, keys: Sequence[ChunkKey], held: bool) -> None:
        with self._lock:
            self.calls.append((tier, [k.key for k in keys], held))
            have = self.held.setdefault(tier, set())
            for key in keys:
                (have.add if held else have.discard)(key.key)


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
    def broken(tier: str, keys: Sequence[ChunkKey], held: bool) -> None:
        raise RuntimeError("watcher bug")

    seen = Seen()
    manager.watch.add(broken)
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
