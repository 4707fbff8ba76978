"""Loading a prefix's chunks from the tiers into the serving engine's pool (the engine's
`retrieve`, and the tail `lookup` counts): the CPU tier's leading hits leased together and
copied in one call, then the rest scattered chunk by chunk as it arrives from the lower tiers
while later chunks are still being read, then the longest stored tail after them.

On a CUDA pool every scatter runs on kvtier's load stream (`DeviceCopies.scatter`), which holds
the objects until the copy has run; the caller never waits. The store path is
`kvtier.engine.saving`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing
from typing import TYPE_CHECKING

import torch

from kvtier.connectors.base import KVConnector
from kvtier.engine import chunk_io
from kvtier.engine.rows import pool_rows
from kvtier.keys import ChunkKey, KeyChain
from kvtier.memory import MemoryObj, lease
from kvtier.storage import StorageManager

if TYPE_CHECKING:
    from kvtier.connectors.streams import DeviceCopies

__all__ = ["PrefixLoader"]


class PrefixLoader:
    """Loads chunks of one engine's keys from `storage` into pool rows through `connector`
    (through `device`'s streams on a CUDA pool); `chunk_size` finds where a tail may start."""

    def __init__(self, storage: StorageManager, connector: KVConnector,
                 device: DeviceCopies | None, chunk_size: int):
        self._storage = storage
        self._connector = connector
        self._device = device
        self._chunk_size = chunk_size

    def load(self, keys: Sequence[ChunkKey], wanted: Sequence[ChunkKey], slots: torch.Tensor,
             skip: int, limit: int, *, hot_only: bool) -> tuple[int, list[ChunkKey]]:
        """Load `wanted` (the chunks of chain `keys` past `skip` and before `limit`), then the
        longest tail after them, into pool rows `slots`; returns the tokens now in the pool
        (not yet cut at `limit`) and the keys asked for (what `unstage` lets go)."""
        load = self.hot if hot_only else self.streaming
        if hot_only:  # what is there is known: one lease and one copy, tail included
            n = self._storage.contains(wanted, hot_only=True)
            wanted = list(wanted[:n]) + self.tail(keys, wanted[n - 1].end if n else skip, limit,
                                                  hot_only=True)
            asked = wanted
            loaded = load(wanted, slots, skip, limit)
        else:
            asked = list(wanted)
            # What the CPU tier holds first, in one copy (its leading hits: one lookup); then
            # the rest as it arrives.
            start = self.hot(wanted, slots, skip, limit)
            loaded = load([k for k in wanted if k.end > start], slots, start, limit)
            tail = self.tail(keys, loaded, limit, hot_only=False)
            loaded = load(tail, slots, loaded, limit)
            asked += tail
        return loaded, asked

    def tail(self, keys: Sequence[ChunkKey], end: int, limit: int, *,
             hot_only: bool) -> list[ChunkKey]:
        """[the longest stored tail after the first `end` tokens] (they end a full chunk, or
        the chunk holding `end` missed), or [] without one or without a `KeyChain`."""
        if not isinstance(keys, KeyChain) or end >= limit:
            return []
        i = end // self._chunk_size
        tail = self._storage.find_tail(keys.tails(i, limit), hot_only=hot_only)
        return [] if tail is None or tail.end <= end else [tail]

    def hot(self, wanted: Sequence[ChunkKey], slots: torch.Tensor, skip: int,
            limit: int) -> int:
        """The CPU tier's leading hits, leased together and copied in one kernel call."""
        if not wanted:
            return skip

        def copy(keys: Sequence[ChunkKey], objs: list[MemoryObj]) -> None:
            self.scatter(objs, pool_rows(slots, keys[0].start, keys[-1].end, skip, limit))

        got = chunk_io.read(self._storage, wanted, copy, hot_only=True)
        return wanted[got - 1].end if got else skip

    def scatter(self, objs: list[MemoryObj], rows: torch.Tensor) -> None:
        if self._device is not None:
            self._device.scatter(objs, rows)  # holds objs until the copy has run
        elif len(objs) == 1:
            self._connector.scatter(objs[0], rows)
        else:
            self._connector.scatter_many(objs, rows)

    def streaming(self, wanted: Sequence[ChunkKey], slots: torch.Tensor,
                  skip: int, limit: int) -> int:
        """Chunks scattered as they arrive, while later ones are still being read."""
        loaded = skip
        if not wanted:
            return loaded
        with closing(self._storage.stream(wanted)) as chunks:
            for key, obj in zip(wanted, chunks):
                with lease([obj]):
                    self.scatter([obj], pool_rows(slots, key.start, key.end, skip, limit))
                loaded = key.end
        return loaded
