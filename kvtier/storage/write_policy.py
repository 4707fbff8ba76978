"""Write policies: when a chunk that reached the hot tier is written to the lower tiers.

- `write_through`: at once, on every put (the default; a lower tier has everything).
- `write_back`: when the hot tier lets go of it (eviction, close); the lower tiers see only
  what memory could not keep.
- `write_through_selective`: once it was served `selective_write_threshold` times; only
  popular prefixes spend lower-tier space.

A hot tier that keeps no puts (`local_cpu: false`) has nothing to write back from: every policy
writes through.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.backends.base import HotTier
from kvtier.config import names
from kvtier.config.schema import WriteSection
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj
from kvtier.storage.writer import TierWriter

__all__ = ["WritePolicy", "WriteThrough", "WriteBack", "WriteThroughSelective", "POLICY_CLASSES",
           "make_write_policy"]

Writers = Sequence[TierWriter]


class WritePolicy:
    """Hooks the storage manager calls; each decides what to hand to the lower-tier writers.

    Writers copy nothing and take their own references, so a hook never gives up the
    caller's references.
    """

    name = "?"
    # Whether a chunk may exist only in the hot tier for a while: the writers then count a
    # predecessor held there as reachable (it will be written before it is dropped).
    holds_back = False

    @classmethod
    def from_section(cls, section: WriteSection) -> WritePolicy:
        return cls()

    def on_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj],
               writers: Writers) -> None:
        """Chunks were just put into the hot tier."""

    def on_hit(self, key: ChunkKey, obj: MemoryObj, writers: Writers) -> None:
        """A chunk was served (from any tier)."""

    def on_evict(self, key: ChunkKey, obj: MemoryObj, writers: Writers) -> None:
        """The hot tier let go of a chunk (called parents first)."""

    def on_close(self, hot: HotTier, size: int, writers: Writers) -> None:
        """The manager is closing; the hot tier still holds its chunks."""


def _submit(keys: Sequence[ChunkKey], objs: Sequence[MemoryObj], writers: Writers) -> None:
    for writer in writers:
        writer.submit(keys, objs)


class WriteThrough(WritePolicy):
    name = names.WRITE_THROUGH

    def on_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj],
               writers: Writers) -> None:
        _submit(keys, objs, writers)


class WriteBack(WritePolicy):
    name = names.WRITE_BACK
    holds_back = True

    def on_evict(self, key: ChunkKey, obj: MemoryObj, writers: Writers) -> None:
        _submit([key], [obj], writers)

    def on_close(self, hot: HotTier, size: int, writers: Writers) -> None:
        # The hot tier holds the only copy: hand everything down, parents first.
        for key, obj in reversed(hot.pop_lru(size)):
            _submit([key], [obj], writers)
            obj.release()


class WriteThroughSelective(WritePolicy):
    """Counts hits per chunk (bounded: past a million chunks the oldest half is forgotten)."""

    name = names.WRITE_THROUGH_SELECTIVE
    MAX_TRACKED = 1_000_000

    def __init__(self, threshold: int):
        self._threshold = threshold
        self._hits: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_section(cls, section: WriteSection) -> WritePolicy:
        return cls(section.selective_threshold)

    def on_hit(self, key: ChunkKey, obj: MemoryObj, writers: Writers) -> None:
        with self._lock:
            count = self._hits.get(key.key, 0) + 1
            self._hits[key.key] = count
            if len(self._hits) > self.MAX_TRACKED:
                for name in list(self._hits)[: len(self._hits) // 2]:
                    del self._hits[name]
        if count == self._threshold:
            _submit([key], [obj], writers)


# name -> class; `kvtier.config.names.WRITE_POLICIES` is the list of names, this builds each.
POLICY_CLASSES: dict[str, type[WritePolicy]] = {
    p.name: p for p in (WriteThrough, WriteBack, WriteThroughSelective)}
# The config offers exactly the names in kvtier.config.names: a policy added there is built here. A
# raise, not an assert, so that `python -O` still refuses a table that lacks one.
if set(POLICY_CLASSES) != set(names.WRITE_POLICIES):
    raise RuntimeError(f"kvtier.storage.write_policy builds {sorted(POLICY_CLASSES)}, but "
                       f"kvtier.config.names lists {sorted(names.WRITE_POLICIES)}")


def make_write_policy(section: WriteSection, hot: HotTier) -> WritePolicy:
    """The policy `section.policy` names (write-through without a hot tier that keeps what is
    put: nothing there to write back from)."""
    name = section.policy if hot.keeps_puts else WriteThrough.name
    return POLICY_CLASSES[name].from_section(section)
