"""Segments' standalone KV in the tiers: the same chunks, records, tiers and encryption as a
prefix's, under segment keys (`segment_chain`). The engine wing's door for blending
(`CacheEngine.segments`): `kvtier.blend` computes, this module stores and reads.

A segment is stored as its full chunks and, with `save_tails`, the longest page-aligned tail
after them; it is read back the same way, leading chunks first, so a segment whose later chunks
were evicted still gives its first tokens (the rest are computed like uncached tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvtier.engine import chunk_io
from kvtier.engine.segment_checks import check_segment
from kvtier.engine.verify import Verdict
from kvtier.keys import ChunkKey, KeyBuilder, KeyChain
from kvtier.memory import KVLayout, MemoryFormat, MemoryObj
from kvtier.storage import StorageManager
from kvtier.storage.prefetch.handle import Prefetch

__all__ = ["Segment", "SegmentStore", "segment_chain"]


class Segment(NamedTuple):
    """Tokens `[start, end)` of a prompt: one segment, separators excluded."""

    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def segment_chain(builder: KeyBuilder, tokens: Sequence[int] | torch.Tensor | np.ndarray,
                  segment: Segment, salt: str = "") -> KeyChain:
    """The keys `segment` of `tokens` is cached under: its full chunks and, with tails on, the
    page-aligned tails after them. The same for the same tokens wherever they stand."""
    ids = tokens[segment.start:segment.end]
    return builder.chain(ids if isinstance(ids, (torch.Tensor, np.ndarray)) else list(ids),
                         salt, segment=True)


class SegmentStore:
    """Puts and reads whole segments' KV (`[2, layers, tokens, kv_width]` tensors).

    Args:
        storage: the engine's storage manager (its tiers hold the segments beside prefixes).
        keys: the engine's key builder (model identity, layout, rank, salt, chunking).
        layout: the engine's KV layout; MHA only (blending re-rotates keys, MLA has none
            apart from its values).
        write_down: False keeps segments in the CPU tier only.

    Raises:
        ValueError: an MLA layout.
    """

    def __init__(self, storage: StorageManager, keys: KeyBuilder, layout: KVLayout, *,
                 write_down: bool = True):
        if layout.fmt is not MemoryFormat.KV_2LTD:
            raise ValueError(f"segments are blended for MHA/GQA KV only, not {layout.fmt.name}")
        self._storage = storage
        self._keys = keys
        self._layout = layout
        self._write_down = write_down

    def chain(self, tokens: Sequence[int] | torch.Tensor | np.ndarray, segment: Segment,
              salt: str = "") -> KeyChain:
        return segment_chain(self._keys, tokens, segment, salt)

    def _wanted(self, chain: KeyChain) -> list[ChunkKey]:
        """What a segment is stored as: its full chunks, then its longest tail if any."""
        return list(chain) + chain.tails(len(chain))[:1]

    def lookup(self, chain: KeyChain, *, hot_only: bool = False) -> int:
        """How many leading tokens of the segment some tier (the CPU tier alone with
        `hot_only`) holds; no data moves."""
        n = self._storage.contains(chain, hot_only=hot_only)
        end = chain[n - 1].end if n else 0
        if n == len(chain):
            tail = self._storage.find_tail(chain.tails(n), hot_only=hot_only)
            end = tail.end if tail is not None else end
        return end

    def start_prefetch(self, chain: KeyChain) -> Prefetch | None:
        """Start loading the segment from disk or Redis into the CPU tier in the background
        (`StorageManager.start_prefetch`); None when the CPU tier holds all of it already."""
        if self.lookup(chain, hot_only=True) >= chain.num_tokens:
            return None
        return self._storage.start_prefetch(chain)

    def save(self, chain: KeyChain, kv: torch.Tensor) -> int:
        """Put the segment's KV (`kv[:, :, i]` is its token i) under `chain`'s keys, from the
        first chunk the CPU tier lacks; returns the end of what is now held from the segment's
        start (0 when the arena has no room: counted as `store_no_memory`).

        Raises:
            ValueError: `kv` does not have the layout's shape and dtype for the segment.
        """
        want = self._layout.shape(chain.num_tokens)
        if tuple(kv.shape) != want or kv.dtype != self._layout.dtype:
            raise ValueError(f"kv must be {want} {self._layout.dtype}, got "
                             f"{tuple(kv.shape)} {kv.dtype}")
        wanted = self._wanted(chain)
        held = self._storage.contains(wanted, hot_only=True)  # put once, like a prefix
        keys = wanted[held:]

        def copy(i: int, obj: MemoryObj) -> None:
            obj.tensor.copy_(kv[:, :, keys[i].start:keys[i].end])

        put = chunk_io.store(self._storage, self._layout, keys, copy,
                             write_down=self._write_down)
        return put[-1].end if put else (wanted[held - 1].end if held else 0)

    def verify(self, chain: KeyChain, kv: torch.Tensor) -> list[Verdict]:
        """Compare every tier's records of the segment with `kv`, its KV computed alone now
        (as `save` takes it), and remove what differs from the tier that holds it; a verdict
        per record compared (`verify.check_segment`)."""
        return check_segment(self._storage, chain, kv)

    def load(self, chain: KeyChain, out: torch.Tensor) -> int:
        """Read the segment's leading stored tokens into `out` (`[2, layers, n, kv_width]`,
        any device); returns how many arrived (0 on a miss)."""
        def copy(keys: Sequence[ChunkKey], objs: list[MemoryObj]) -> None:
            for key, obj in zip(keys, objs):
                out[:, :, key.start:key.end].copy_(obj.tensor, non_blocking=False)

        keys = list(chain)
        got = chunk_io.read(self._storage, keys, copy)
        loaded = keys[got - 1].end if got else 0
        if loaded == chain.num_tokens - chain.num_tokens % self._keys.chunk_size:
            tail = self._storage.find_tail(chain.tails(len(chain)))
            if tail is not None and chunk_io.read(self._storage, [tail], copy):
                loaded = tail.end
        return loaded
