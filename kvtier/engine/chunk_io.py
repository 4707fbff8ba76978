"""The one path the engine wing's doors move chunks by: arena objects allocated for a run of
chunks, filled from the caller's tensors, put under their keys; and the leading hits of a run of
keys read into the caller's destinations.

`PrefixSaver` and `PrefixLoader` (the engine's store and retrieve), `PageStore` (SGLang's
HiCache L3) and `SegmentStore` (blending) each keep only what is their own (keys, verification,
tails, pool rows) and call these for the rest, so a run stops at the same place whichever door
it came through: allocation at the first chunk that finds no memory, a put at the last chunk
that was filled, a read at the first miss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease
from kvtier.storage import StorageManager

__all__ = ["allocate", "fill", "put", "read", "store"]

# A copy of chunk `i` of a run into (or out of) its arena object.
CopyOne = Callable[[int, MemoryObj], object]


def allocate(storage: StorageManager, layout: KVLayout, sizes: Sequence[int], *,
             arena: MemoryAllocator | None = None,
             no_memory: str | None = "store_no_memory") -> list[MemoryObj]:
    """New objects in `arena` (default the CPU tier's) of `sizes[i]` tokens each, up to the
    first that finds no memory; that miss is counted once under `no_memory` (None: not
    counted). The caller owns the objects (one reference each)."""
    pool = storage.allocator if arena is None else arena
    objs: list[MemoryObj] = []
    for size in sizes:
        obj = pool.allocate(layout, size)
        if obj is None:
            if no_memory is not None:
                storage.counters.inc(no_memory)
            break
        objs.append(obj)
    return objs


def fill(storage: StorageManager, layout: KVLayout, sizes: Sequence[int], copy: CopyOne, *,
         no_memory: str | None = "store_no_memory") -> list[MemoryObj]:
    """`allocate`, then `copy(i, obj)` into each object in order. The caller owns what is
    returned; if a copy raises, every object allocated here is released first."""
    objs = allocate(storage, layout, sizes, no_memory=no_memory)
    try:
        for i, obj in enumerate(objs):
            copy(i, obj)
    except BaseException:
        for obj in objs:
            obj.release()
        raise
    return objs


def put(storage: StorageManager, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj], *,
        write_down: bool = True) -> Sequence[ChunkKey]:
    """Put `objs` under the leading run `keys[:len(objs)]` (a read stops where the run stops);
    with `write_down=False` in the CPU tier only. Returns the keys put. The caller keeps its
    references."""
    done = keys[:len(objs)]
    storage.put(done, objs, write_down=write_down)
    return done


def store(storage: StorageManager, layout: KVLayout, keys: Sequence[ChunkKey], copy: CopyOne, *,
          write_down: bool = True, no_memory: str | None = "store_no_memory",
          ) -> Sequence[ChunkKey]:
    """`fill` the chunks of `keys` and `put` the run that was filled; no object outlives the
    call. Returns the keys put (fewer than `keys` when memory ran out)."""
    objs = fill(storage, layout, [k.num_tokens for k in keys], copy, no_memory=no_memory)
    with lease(objs):
        return put(storage, keys, objs, write_down=write_down)


def read(storage: StorageManager, keys: Sequence[ChunkKey],
         copy: Callable[[Sequence[ChunkKey], list[MemoryObj]], object], *,
         hot_only: bool = False, unstage: bool = False) -> int:
    """Lease the leading hits of `keys` (the CPU tier's alone with `hot_only`) and hand them to
    `copy(hit_keys, objs)` once, while leased; not called on a miss. With `unstage` a staging
    tier (`local_cpu: false`) keeps nothing of them afterwards. Returns the number of hits."""
    with storage.get(keys, hot_only=hot_only) as objs:
        got = len(objs)
        if got:
            copy(keys[:got], objs)
    if unstage:
        storage.unstage(keys[:got])
    return got
