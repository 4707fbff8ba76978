"""Saving a prefix's chunks from the serving engine's pool into the CPU tier (the engine's
`store`): objects allocated in the arena, filled from the pool rows, then put.

On a CPU pool every chunk of a store is filled by one kernel call, and storing stops before the
first chunk with a `-1` slot.
On a CUDA pool every chunk of a store is filled by one copy on kvtier's store stream
(`DeviceCopies.gather`), which checks the slots on the GPU: chunks up to the first one that met a
`-1` slot are kept, and a slot out of range fails the whole store before anything is put.

The chunks the admission policy refuses the CPU tier are filled into the write-around buffer
and handed to the lower tiers only (`kvtier.engine.around`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.connectors.base import KVConnector
from kvtier.engine import chunk_io
from kvtier.engine.around import around_buffer
from kvtier.kernels.host_copy import STATUS_BAD
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease
from kvtier.storage import StorageManager

if TYPE_CHECKING:
    from kvtier.connectors.streams import DeviceCopies

__all__ = ["PrefixSaver"]


class PrefixSaver:
    """Fills and puts the chunks of one store (see the module docstring)."""

    def __init__(self, storage: StorageManager, layout: KVLayout, connector: KVConnector,
                 device: DeviceCopies | None, write_down: bool = True):
        """`write_down=False`: chunks go to the CPU tier only, never to the lower tiers (MLA
        KV is the same on every TP rank: rank 0 alone writes it down, every rank keeps it in
        its own CPU tier, the one tier ranks do not share)."""
        self._write_down = write_down
        self._storage = storage
        self._layout = layout
        self._connector = connector
        self._device = device
        self._around = around_buffer(storage, layout, write_down)

    def close(self) -> None:
        """Release the write-around buffer (once the storage manager drained its writers)."""
        if self._around is not None:
            self._around.close()

    def save(self, keys: Sequence[ChunkKey], slots: torch.Tensor,
             on_read: Callable[[], None] | None, extra: ChunkKey | None,
             ready: torch.cuda.Event | None, *, unwritten: bool = True,
             declared: bool = False) -> int:
        """Put `keys` (from the first the CPU tier lacks) and the inner tail `extra`; calls
        `on_read` once the pool rows are read; returns the number of tokens newly stored.
        `unwritten=False`: the caller knows no slot is -1 (no chunk is checked for one).
        `declared`: the caller declared the prefix's reuse (a session's turn, a retained
        prefix): stored past the admission policy, which only guesses it."""
        if self._device is not None:
            return self._save_on_gpu(keys, slots, on_read, extra, ready, declared)
        return self._save_on_cpu(keys, slots, on_read, extra, unwritten, declared)

    def _save_on_cpu(self, keys: Sequence[ChunkKey], slots: torch.Tensor,
                     on_read: Callable[[], None] | None, extra: ChunkKey | None = None,
                     unwritten: bool = True, declared: bool = False) -> int:
        todo = keys[self._storage.contains(keys, hot_only=True):]
        if unwritten and todo:  # stop before the first chunk with a -1 slot
            start = todo[0].start
            skipped = (slots[start:todo[-1].end] < 0).nonzero()
            if skipped.numel():
                cut = start + int(skipped[0])
                todo = [k for k in todo if k.end <= cut]
        todo, extra, refused = self._admit(todo, extra, declared)
        objs: list[MemoryObj] = []
        around: list[MemoryObj] = []
        with lease(objs), lease(around):
            inner = self._gather_one(extra, slots) if extra is not None else None
            if inner is not None:
                objs.append(inner)  # released with the others
            chunks = self._allocate(todo)
            objs += chunks
            if chunks:  # one kernel call for every chunk
                start, end = todo[0].start, todo[len(chunks) - 1].end
                whole = start == 0 and end == slots.numel()  # a slice costs more than it looks
                self._connector.gather_many(slots if whole else slots[start:end], chunks)
            around += self._fill_around(refused, slots, None)
            if on_read is not None:
                on_read()
            stored = todo[:len(chunks)]
            self._put(stored, chunks)
            if inner is not None and extra is not None:
                self._put([extra], [inner])
            self._write_around(refused, around)
        n = sum(k.num_tokens for k in stored)
        self._storage.counters.inc("tokens_stored", n)
        return n

    def fill(self, keys: Sequence[ChunkKey], slots: torch.Tensor,
             ready: torch.cuda.Event | None, arena: MemoryAllocator | None = None,
             ) -> list[MemoryObj]:
        """New objects in `arena` (default the CPU tier's) holding consecutive chunks `keys`
        from the pool rows `slots`, put nowhere (the caller owns them): up to the first that
        finds no memory, or (CUDA) met a -1 slot. On a CUDA pool this waits for the copy."""
        objs = self._allocate(keys, arena)
        if not objs:
            return objs
        rows = slots[keys[0].start:keys[len(objs) - 1].end]
        if self._device is None:
            unwritten = (rows < 0).nonzero()
            if unwritten.numel():  # keep the chunks before the first -1 slot
                n = sum(k.end <= keys[0].start + int(unwritten[0]) for k in keys[:len(objs)])
                for obj in objs[n:]:
                    obj.release()
                objs, rows = objs[:n], rows[:keys[n - 1].end - keys[0].start] if n else rows[:0]
            if objs:
                self._connector.gather_many(rows, objs)
            return objs
        status = self._device.gather([rows], objs, ready)
        whole = [word == 0 for word in status]
        n = whole.index(False) if False in whole else len(whole)
        for obj in objs[n:]:
            obj.release()
        return objs[:n]

    def _put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> None:
        chunk_io.put(self._storage, keys, objs, write_down=self._write_down)

    def _admit(self, todo: list[ChunkKey] | Sequence[ChunkKey], extra: ChunkKey | None,
               declared: bool = False) -> tuple[list[ChunkKey], ChunkKey | None, list[ChunkKey]]:
        """The leading chunks of `todo` the admission policy takes (`StorageManager.admit`;
        all of them when `declared`), the inner tail unless a chunk before it was refused (it
        would hang off nothing), and the refused chunks the lower tiers get around the CPU
        tier (none without a buffer)."""
        todo = list(todo)
        n = len(todo) if declared else self._storage.admit(todo) if todo else 0
        if n == len(todo):
            return todo, extra, []
        around = self._around is not None and bool(self._storage.lower_tiers)
        return todo[:n], None, todo[n:] if around else []

    def _fill_around(self, keys: list[ChunkKey], slots: torch.Tensor,
                     ready: torch.cuda.Event | None) -> list[MemoryObj]:
        """The refused `keys` filled into the write-around buffer (as many as fit)."""
        return self.fill(keys, slots, ready, self._around) if keys else []

    def _write_around(self, keys: list[ChunkKey], objs: list[MemoryObj]) -> None:
        if objs and self._storage.write_around(keys[:len(objs)], objs):
            self._storage.counters.inc("written_around", len(objs))

    def _allocate(self, keys: Sequence[ChunkKey], arena: MemoryAllocator | None = None,
                  ) -> list[MemoryObj]:
        """Objects in `arena` (default the CPU tier's) for `keys`, up to the first that finds
        no memory (counted)."""
        return chunk_io.allocate(self._storage, self._layout, [k.num_tokens for k in keys],
                                 arena=arena, no_memory="store_no_memory" if arena is None
                                 else "write_around_no_memory")

    def _save_on_gpu(self, keys: Sequence[ChunkKey], slots: torch.Tensor,
                     on_read: Callable[[], None] | None, extra: ChunkKey | None,
                     ready: torch.cuda.Event | None, declared: bool = False) -> int:
        """`_save_on_cpu` for a CUDA pool: one copy for every chunk, slots checked by the
        kernel; chunks up to the first one that met a -1 slot are kept."""
        assert self._device is not None
        hot = self._storage.contains
        todo, extra, refused = self._admit(list(keys[hot(keys, hot_only=True):]), extra,
                                           declared)
        inner = extra is not None and not hot([extra], hot_only=True)
        if inner and extra is not None:
            todo.insert(0, extra)
        objs: list[MemoryObj] = []
        around: list[MemoryObj] = []
        with lease(objs), lease(around):
            objs += self._allocate(todo)
            todo = todo[:len(objs)]
            runs = [slots[k.start:k.end] for k in todo[:1 if inner else 0]]
            if len(todo) > len(runs):  # the chunks after the inner tail are consecutive
                runs.append(slots[todo[len(runs)].start:todo[-1].end])
            status = self._device.gather(runs, objs, ready) if objs else []
            around += self._fill_around(refused, slots, ready)
            if on_read is not None:
                on_read()
            if any(word & STATUS_BAD for word in status):
                raise ValueError(f"slot_mapping holds values outside [-1, "
                                 f"{self._connector.num_slots}); nothing was stored")
            whole = [word == 0 for word in status]
            tail: tuple[list[ChunkKey], list[MemoryObj]] = ([], [])
            if inner and objs:
                if whole[0]:
                    tail = todo[:1], objs[:1]
                todo, objs, whole = todo[1:], objs[1:], whole[1:]
            n = whole.index(False) if False in whole else len(whole)
            self._put(todo[:n], objs[:n])
            self._put(*tail)  # after the chunk it hangs off: writers drop orphans
            self._write_around(refused, around)
        stored = sum(k.num_tokens for k in todo[:n])
        self._storage.counters.inc("tokens_stored", stored)
        return stored

    def _gather_one(self, key: ChunkKey, slots: torch.Tensor) -> MemoryObj | None:
        """A new object holding `key`'s rows, or None (held already, no memory, -1 slots)."""
        rows = slots[key.start:key.end]
        if self._storage.contains([key], hot_only=True) or bool((rows < 0).any()):
            return None
        objs = chunk_io.allocate(self._storage, self._layout, [key.num_tokens], no_memory=None)
        if objs:
            self._connector.gather(rows, objs[0])
        return objs[0] if objs else None
