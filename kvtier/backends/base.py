"""The contract every storage tier implements.

All calls are batched and take keys in sequence order (a single key is a batch of one).
Prefix semantics: `batch_contains` and `batch_get` stop at the first miss, because a chunk is
useless without the chunks before it.

Ownership: `batch_get` returns objects the caller owns one reference to each; `batch_put` never
takes over the caller's references (a tier that keeps an object retains it itself).

Failures: a tier that cannot be reached or finds a corrupt record answers with a miss (and counts
it); only bad arguments raise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from kvtier.config import Config
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj

__all__ = ["BackendContext", "StorageBackend"]


@dataclass(frozen=True)
class BackendContext:
    """What a tier needs from the engine: the config, the chunk layout and the arena."""

    config: Config
    layout: KVLayout
    allocator: MemoryAllocator

    def allocate(self, num_tokens: int) -> MemoryObj | None:
        """A fresh object for `num_tokens` tokens, or None when the arena is full."""
        return self.allocator.allocate(self.layout, num_tokens)


class StorageBackend(ABC):
    """One storage tier (cpu, disk, redis)."""

    name: str = "?"

    @abstractmethod
    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        """The number of leading `keys` this tier holds (stops at the first miss).

        Looks at key strings only (`ChunkKey.key`): callers may pass keys whose other fields
        are empty when only the key string is known.
        """

    @abstractmethod
    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """Objects for the leading hits of `keys`, verified against each key's tokens.

        Stops at the first miss, corrupt record or failed allocation. The caller owns one
        reference to every returned object.
        """

    def iter_get(self, keys: Sequence[ChunkKey]) -> Generator[MemoryObj, None, None]:
        """`batch_get` as a stream: each object is yielded as soon as it arrived, so a caller
        can copy one chunk while the next ones are read. Same ownership and stop rules.

        Closing the generator early releases whatever was read ahead. The default reads the
        whole batch first; tiers with slow reads override it to pipeline.
        """
        yield from self.batch_get(keys)

    @abstractmethod
    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        """Store `objs[i]` under `keys[i]`; returns how many were stored.

        Never takes over the caller's references. Writes are atomic per chunk: a reader sees the
        whole chunk or nothing. A failed write is counted and skipped, never raised.
        """

    @abstractmethod
    def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Delete `keys` that are present; returns how many were deleted."""

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters and gauges for metrics and `kvtier stats` (names are snake_case)."""

    @abstractmethod
    def close(self) -> None:
        """Release resources; idempotent. Calls after close are misses/no-ops."""
