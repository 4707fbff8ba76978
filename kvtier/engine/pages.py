"""`PageStore`: pages of a serving engine's host pool stored by key, for SGLang's HiCache L3
(`integration/sglang/hicache/storage.py`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import torch

from kvtier.config import Config
from kvtier.engine import chunk_io
from kvtier.engine.verify import sampled, sampling_key, shadow_check
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryObj
from kvtier.storage import StorageManager

__all__ = ["PageStore"]


class PageStore:
    """Pages of `page_size` tokens in `layout`, stored under the caller's keys in the tiers
    `config` names (CPU, disk, Redis: their write policy and failure handling included).

    Keys come in prefix order, as everywhere in kvtier: `held` and `read` stop at the first
    miss. Reads copy into the caller's destinations and writes copy from the caller's page
    tensors; no arena object outlives a call. With `writes` false (a replica of MLA KV that
    another rank writes) `write` stores nothing and reports success.
    """

    def __init__(self, config: Config, layout: KVLayout, page_size: int, *,
                 writes: bool = True):
        self.layout = layout
        self.page_size = page_size
        self._writes = writes
        self._storage = StorageManager(config, layout)
        self.verify_fraction = config.verify_fraction
        self._sampling_key = sampling_key()

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._storage.tiers]

    def held(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading pages of `keys` some tier holds."""
        return self._storage.contains(keys)

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """`held`, for a serving engine deciding what to load: a query sampled for shadow
        verification (`verify_fraction`) finds nothing, so its pages are computed, and
        `write` compares them with the tiers' records before it stores them."""
        if self.verify_fraction > 0 and sampled(uuid.uuid4().hex, self.verify_fraction,
                                                self._sampling_key):
            return 0
        return self.held(keys)

    def read(self, keys: Sequence[ChunkKey],
             dests: Sequence[Callable[[torch.Tensor], object]]) -> int:
        """Copy the leading hits of `keys` into `dests[i](flat_page)`; returns how many. A
        staging tier (`local_cpu: false`) keeps nothing of them afterwards."""
        def copy(_: Sequence[ChunkKey], objs: list[MemoryObj]) -> None:
            for obj, put in zip(objs, dests, strict=False):
                put(obj.tensor.view(-1))

        return chunk_io.read(self._storage, keys, copy, unstage=True)

    def write(self, keys: Sequence[ChunkKey], pages: Sequence[torch.Tensor]) -> bool:
        """Store `pages[i]` under `keys[i]` (lower tiers in the background); False when the
        arena had no room for every page (the leading ones that fit are stored). While
        verification is on, pages some tier holds already are first compared with its records
        (`verify.shadow_check`: a page that differs is counted, logged and removed, then
        stored fresh)."""
        if not self._writes:
            return True
        if self.verify_fraction > 0:
            shadow_check(self._storage, keys, 0, lambda todo: self._fill(pages[:len(todo)]))
        put = chunk_io.store(self._storage, self.layout, keys[:len(pages)],
                             self._copier(pages), no_memory=None)
        return len(put) == len(keys)

    def _fill(self, pages: Sequence[torch.Tensor]) -> list[MemoryObj]:
        """Arena objects holding copies of `pages`, up to the first that finds no memory."""
        return chunk_io.fill(self._storage, self.layout, [self.page_size] * len(pages),
                             self._copier(pages), no_memory=None)

    @staticmethod
    def _copier(pages: Sequence[torch.Tensor]) -> chunk_io.CopyOne:
        def copy(i: int, obj: MemoryObj) -> None:
            obj.tensor.view(-1).copy_(pages[i].reshape(-1))
        return copy

    def arena_bytes_used(self) -> int:
        """Bytes of the arena in use (between calls: what the CPU or staging tier keeps)."""
        return self._storage.allocator.used_bytes

    def stats(self) -> dict[str, float]:
        return self._storage.stats()

    def close(self) -> None:
        """Drain background writes and release the tiers. Idempotent."""
        self._storage.close()
