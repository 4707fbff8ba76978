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
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvtier.backends.inventory import RecordInventory, StoredRecord
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj
from kvtier.metrics import Counters

if TYPE_CHECKING:  # annotations only: the tiers' contract does not import the config loader
    from kvtier.backends.codec import Codec
    from kvtier.backends.sealing import RecordKeys
    from kvtier.config import Config

__all__ = ["BackendContext", "StorageBackend", "HotTier", "ProbeSample", "PROBE_PREFIX",
           "StoredRecord", "RecordInventory", "EvictionWatch", "check_batch"]

# Scratch records of `StorageBackend.probe` carry this in their names (Redis: inside the tier's
# key prefix, which a tenant's ACL allows): never a record's name, so no listing, lookup or
# purge of records ever sees one.
PROBE_PREFIX = "kvtier-probe"


class ProbeSample(NamedTuple):
    """One place a tier's reads go (a disk, a Redis primary), timed with a scratch record."""

    round_trip_s: float  # a lookup that moved no data
    read_bytes: int
    read_s: float  # the read of `read_bytes`, its round trip included


@dataclass(frozen=True)
class BackendContext:
    """What a tier needs from the engine: the config, the chunk layout, the arena, and the
    counters it counts its events in (under a `scope` of its name)."""

    config: Config
    layout: KVLayout
    allocator: MemoryAllocator
    counters: Counters = field(default_factory=Counters)

    def allocate(self, num_tokens: int) -> MemoryObj | None:
        """A fresh object for `num_tokens` tokens, or None when the arena is full."""
        return self.allocator.allocate(self.layout, num_tokens)

    @cached_property
    def record_key(self) -> RecordKeys | None:
        """The keys records are encrypted with (`record_key_file`, read once), or None.
        `ConfigError` if the file cannot be read or holds too short a key."""
        from kvtier.backends.sealing import load_record_keys

        return load_record_keys(self.config.record_key_file)

    @cached_property
    def codec(self) -> Codec:
        """The codec the tier writes records in (`remote_serde`, kvtier/backends/codec.py);
        it reads records of every codec it knows."""
        from kvtier.backends.codec import codec_named

        return codec_named(self.config.remote_serde)


class StorageBackend(ABC):
    """One storage tier (cpu, disk, redis)."""

    name: str = "?"

    @abstractmethod
    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        """The number of leading `keys` this tier holds (stops at the first miss).

        Looks at key strings only (`ChunkKey.key`): callers may pass keys whose other fields
        are empty when only the key string is known.
        """

    def first_held(self, keys: Sequence[ChunkKey]) -> int:
        """The index of the first of `keys` this tier holds, -1 if none: alternatives (a
        prefix's candidate tails, longest first), not a prefix. Key strings only, as
        `batch_contains`. The default asks one key at a time; remote tiers batch it."""
        for i, key in enumerate(keys):
            if self.batch_contains([key]):
                return i
        return -1

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
        objs = self.batch_get(keys)
        handed = 0
        try:
            for obj in objs:
                handed += 1  # before the yield: a close there leaves this one with the caller
                yield obj
        finally:
            for obj in objs[handed:]:
                obj.release()

    @abstractmethod
    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        """Store `objs[i]` under `keys[i]`; returns how many were stored.

        Never takes over the caller's references. Writes are atomic per chunk: a reader sees the
        whole chunk or nothing. A failed write is counted and skipped, never raised.
        """

    @abstractmethod
    def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Delete `keys` that are present; returns how many were deleted."""

    def touch(self, keys: Sequence[ChunkKey]) -> None:  # noqa: B027 - a no-op by default
        """`keys` (a prefix, in order) were just served by a faster tier: those this tier
        holds count as used now, the first as the most recent (a prefix is used front to
        back and evicted from its end), so its eviction does not take the prefixes the tiers
        above keep serving.

        Advisory and cheap: called on the serving thread, so no I/O and no waiting on a
        tier's writes (a tier that cannot note it in memory does nothing); changes recency
        only, never what is held; keys it does not hold are ignored; never raises for a
        miss; a no-op after close. Key strings only, as `batch_contains`.
        """

    def watch_evictions(self, watch: EvictionWatch) -> None:  # noqa: B027 - a no-op by default
        """Tell `watch` (while it is `watching`) the key strings of the chunks this tier drops
        on its own (its cap, a full device), on the evicting thread. A no-op for a tier that
        never does or cannot tell (Redis evicts and expires keys unseen by kvtier)."""

    def probe(self, nbytes: int) -> list[ProbeSample]:
        """Time this tier whatever it holds: write a scratch record of `nbytes` under a name
        carrying `PROBE_PREFIX`, where the tier may write (never a record, never listed or
        counted as data), time a lookup and a read of it, and delete it, also when a step fails
        (a remote scratch record expires by itself besides). One sample per place reads go
        (each primary of a Redis Cluster); [] where the tier cannot be probed. A failure
        raises, as any call."""
        return []

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """This tier's counters (all declared ones, zeros included) and gauges, snake_case
        names without the tier prefix."""

    @abstractmethod
    def close(self) -> None:
        """Release resources; idempotent. Calls after close are misses/no-ops."""


class EvictionWatch(Protocol):
    """What `StorageBackend.watch_evictions` tells (`kvtier.storage.watch.TierWatch`)."""

    @property
    def watching(self) -> bool: ...

    def removed(self, tier: str, keys: Sequence[str]) -> None: ...


def check_batch(keys: Sequence[ChunkKey], objs: Sequence[MemoryObj], layout: KVLayout) -> None:
    """`ValueError` naming the first of `keys`/`objs` that do not pair up under `layout` (a
    `batch_put`'s arguments, checked before anything is written)."""
    if len(keys) != len(objs):
        raise ValueError(f"keys and objs differ in length: {len(keys)} != {len(objs)}")
    for i, (key, obj) in enumerate(zip(keys, objs, strict=True)):
        if obj.fmt != layout.fmt or obj.num_tokens != key.num_tokens \
                or obj.nbytes != layout.nbytes(key.num_tokens):
            raise ValueError(f"objs[{i}]: {obj!r} does not match the layout of keys[{i}]")
        if len(key.tokens) != 4 * key.num_tokens:
            raise ValueError(f"keys[{i}]: {len(key.tokens)} token bytes for "
                             f"{key.num_tokens} tokens")


class HotTier(StorageBackend):
    """The tier puts land in first and lower-tier hits are promoted into: objects resident in
    the arena. Besides the tier calls it gives the arena eviction and sessions pinning.

    `keeps_puts` is False for a staging tier (`local_cpu: false`): it
    holds only what loads bring up from the lower tiers, until the load's request took it
    (`StorageManager.unstage`); puts pass it by, straight to the lower tiers.
    """

    keeps_puts: bool = True

    @abstractmethod
    def pop_lru(self, nbytes: int) -> list[tuple[ChunkKey, MemoryObj]]:
        """Unlink least recently used leaves nobody else references and that are not pinned,
        until at least `nbytes` are reclaimable; the caller receives the tier's reference to
        each, in eviction order (a leaf before its parent)."""

    @abstractmethod
    def pin(self, keys: Sequence[ChunkKey]) -> int:
        """Exempt the leading `keys` this tier holds from eviction (pins count per holder);
        returns how many were pinned. Undo with `unpin(keys[:n])`."""

    @abstractmethod
    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Drop one pin of each of `keys` (as pinned by `pin`)."""

    @property
    @abstractmethod
    def pinned_bytes(self) -> int:
        """Bytes of the chunks that hold at least one pin."""
