"""kvtier's tiers as SGLang KV events: a router sees which server's tiers hold a prefix.

SGLang publishes what its device cache gains and loses (`--kv-events-config`: `BlockStored`,
`BlockRemoved`, over ZMQ); a cache-aware router (SMG) routes on them. With kvtier the prefix
often outlives the device copy in kvtier's tiers, so each scheduler also publishes what they
gain and lose, on SGLang's own publisher, with the medium of the tier: `CPU_PINNED` (kvtier's
CPU tier), `DISK`, `EXTERNAL` (Redis: shared by the servers, so its events come from the
server that wrote the block; a server that starts on a Redis others filled announces nothing
of it until it writes or reads a prefix itself).

The events name SGLang's own block hashes, at SGLang's page size and `cache_salt`
namespacing, computed by SGLang's own recorder (`KVCacheEventRecorder`) over the chunk's
tokens: a consumer joins a tier's events with the device's without knowing kvtier's keys. A
chunk's pages chain to the previous chunk's last page, so a chunk is announced only when the
previous one was (prefix order: a store names its chunks first to last), and a chain is
announced only from a prompt's first chunk: a blending segment's chunks (cached as if the
segment were a whole prompt, found only by a blend) are not prefixes a request can hit, so
none of them is. The last `MAX_CHUNKS` announced chunks' hashes are kept for their removal.

Costs: nothing without `--kv-events-config` (no watcher is added). With it, the hashes of a
chunk are computed once, on the thread that stored it (never the scheduler's), and events wait
in a bounded queue (`MAX_EVENTS`) for SGLang's next publishing step: beyond it they are
dropped and counted (`sglang.tier_events_dropped`), never waited for.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvtier.config.tiers import TABLE

if TYPE_CHECKING:
    from kvtier.integration.sglang.boundary.sglang_views import Opaque
    from kvtier.keys import ChunkKey
    from kvtier.metrics import Counters

__all__ = ["TierEvents", "MAX_EVENTS", "MAX_CHUNKS"]

MAX_EVENTS = 8192  # queued between two publishing steps of the scheduler
MAX_CHUNKS = 1 << 17  # chunks whose block hashes are kept for their removal (~0.5 KB each)
COUNTERS = ("tier_events", "tier_events_dropped", "tier_events_unchained")


class _Blocks(NamedTuple):
    """One announced chunk: its pages' event hashes, and the last page's hash strings the
    next chunk's first page chains to (SGLang's storage chain and its salted event chain)."""

    hashes: list[int]
    last: str
    last_event: str | None


def _medium(tier: str) -> str:
    """The tier's medium in the tier table (`TierSpec.medium`; the staging tier has none)."""
    return next((spec.medium for spec in TABLE if spec.name == tier), "")


class TierEvents:
    """A tier watcher (`CacheEngine.tiers.watch`) that turns tier changes into SGLang KV
    events, for `take` on the scheduler thread. Thread-safe.

    Args:
        page_size, dynamo_format, lora_names: what the tree's own recorder was made with
            (SGLang's `CacheInitParams`): the events' page size, hash format and LoRA names.
        counters: where the events, the drops and the chunks not announced are counted.
        starts_prefix: whether a chunk with no predecessor begins a prompt's chain
            (`KeyBuilder.starts_prefix` of the engine's keys), not a segment's.
    """

    def __init__(self, page_size: int, counters: Counters, *,
                 starts_prefix: Callable[[ChunkKey], bool], dynamo_format: bool = False,
                 lora_names: Opaque = None, max_events: int = MAX_EVENTS,
                 max_chunks: int = MAX_CHUNKS) -> None:
        from sglang.srt.mem_cache.events import KVCacheEventRecorder

        self.page_size = page_size
        # SGLang's Python recorder computes the hashes (the Rust tree core's are the same)
        self._hasher = KVCacheEventRecorder(enabled=True, page_size=page_size,
                                            dynamo_format=dynamo_format, lora_names=lora_names)
        self._counters = counters
        self._starts_prefix = starts_prefix
        counters.declare(*(f"sglang.{name}" for name in COUNTERS))
        self._max_events, self._max_chunks = max_events, max_chunks
        self._lock = threading.Lock()
        self._queue: list[object] = []
        self._chunks: OrderedDict[str, _Blocks] = OrderedDict()

    def stored(self, tier: str, keys: Sequence[ChunkKey]) -> None:
        if medium := _medium(tier):
            with self._lock:
                self._enqueue([e for key in keys for e in self._stored(key, medium)])

    def removed(self, tier: str, keys: Sequence[str]) -> None:
        if medium := _medium(tier):
            with self._lock:
                self._enqueue(self._removed(keys, medium))

    def take(self) -> list[object]:
        """The events queued since the last call (scheduler thread, each publishing step)."""
        with self._lock:
            events, self._queue = self._queue, []
        return events

    def _enqueue(self, events: list[object]) -> None:
        room = self._max_events - len(self._queue)
        if len(events) > room:
            self._counters.inc("sglang.tier_events_dropped", len(events) - max(room, 0))
            events = events[:max(room, 0)]
        self._queue.extend(events)
        self._counters.inc("sglang.tier_events", len(events))

    def _stored(self, key: ChunkKey, medium: str) -> list[object]:
        blocks = self._chunks.get(key.key)
        if blocks is None:
            made = self._hash(key, medium)
            if made is None:
                return []
            blocks, events = made
            self._chunks[key.key] = blocks
            if len(self._chunks) > self._max_chunks:
                self._chunks.popitem(last=False)
            return events
        self._chunks.move_to_end(key.key)
        return [self._event(key, blocks, medium)]

    def _removed(self, keys: Sequence[str], medium: str) -> list[object]:
        from sglang.srt.disaggregation.kv_events import BlockRemoved

        hashes = [h for key in keys if (b := self._chunks.get(key)) for h in b.hashes]
        return [BlockRemoved(block_hashes=hashes, medium=medium)] if hashes else []

    def _hash(self, key: ChunkKey, medium: str) -> tuple[_Blocks, list[object]] | None:
        """The chunk's events by SGLang's recorder: the chunk as a tree node below a node
        standing for its prefix (which carries the previous chunk's last hashes)."""
        from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

        tokens = np.frombuffer(key.tokens, dtype="<u4")
        whole = len(tokens) // self.page_size * self.page_size  # the device holds whole pages
        prev = self._chunks.get(key.prev) if key.prev is not None else None
        if whole == 0 or (prev is None if key.prev is not None else not self._starts_prefix(key)):
            self._counters.inc("sglang.tier_events_unchained")
            return None
        salt = key.salt or None
        root = TreeNode()
        root.key, root.hash_value = RadixKey([], cache_salt=salt), []
        parent = root
        if prev is not None:
            parent = TreeNode()
            parent.parent, parent.key = root, RadixKey([0] * self.page_size, cache_salt=salt)
            parent.hash_value = [prev.last]
            parent.event_hash_value = [prev.last_event] if prev.last_event else None
        node = TreeNode()
        node.parent, node.key = parent, RadixKey(tokens[:whole].tolist(), cache_salt=salt)
        self._hasher.record_store(node, medium)
        events = self._hasher.take()
        hashes = [h for event in events for h in event.block_hashes]
        last_event = node.event_hash_value[-1] if node.event_hash_value else None
        return _Blocks(hashes, node.hash_value[-1], last_event), events

    def _event(self, key: ChunkKey, blocks: _Blocks, medium: str) -> object:
        """A chunk announced before, now in another tier (or again): its event from the
        hashes kept, with the previous chunk's last hash as its parent."""
        from sglang.srt.disaggregation.kv_events import BlockStored

        prev = self._chunks.get(key.prev) if key.prev is not None else None
        tokens = np.frombuffer(key.tokens, dtype="<u4")
        whole = len(blocks.hashes) * self.page_size
        return BlockStored(block_hashes=list(blocks.hashes),
                           parent_block_hash=prev.hashes[-1] if prev else None,
                           token_ids=tokens[:whole].tolist(), block_size=self.page_size,
                           lora_id=None, medium=medium, cache_salt=key.salt or None)
