"""The hot tier: memory objects resident in the arena, LRU by chunk (`eviction_policy: lru`;
the other policies subclass it: `kvtier.backends.cpu_tier`).

Eviction takes suffixes first, so a lookup after memory pressure still finds a usable prefix
rather than holes: a batch is touched from its last chunk to its first (within a prefix the
deeper chunks are older), and only leaves are evicted: a chunk whose child is cached stays until
the child is gone, however the chunks were put (one call or many).

Tenants (a chunk's `salt`, SGLang's `cache_salt`; unsalted chunks are one tenant) share the tier
under `tenant_max_fraction`: while more than one tenant holds chunks, an eviction takes the
policy's first leaf of a tenant holding more than that share of the tier, and only when no such
leaf can go the policy's first leaf of anyone. A tenant alone keeps the whole tier, and the
tier stays full: the share decides whose chunks go, never leaves room unused.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.backends.base import BackendContext, HotTier
from kvtier.config.names import CPU
from kvtier.keys import ChunkKey
from kvtier.memory import ALIGN, MemoryObj

__all__ = ["CPUBackend"]


class CPUBackend(HotTier):
    """Holds one reference to every stored object; `pop_lru` hands references back."""

    name = CPU
    _parent_next = True  # a parent left a leaf goes next (False: the policy's queue places it)

    def __init__(self, ctx: BackendContext, *, name: str | None = None):
        if name is not None:  # another role (`staging`): its counters' prefix too
            self.name = name
        self._lock = threading.Lock()
        # LRU first (a policy with its own order may leave it in store order: no decision reads it)
        self._entries: OrderedDict[str, tuple[ChunkKey, MemoryObj]] = OrderedDict()
        self._children: dict[str, int] = {}  # key -> number of cached chunks whose prev it is
        # The entries eviction may take (no cached child, not pinned), in LRU order: an
        # eviction never walks past pinned chunks or parents (thousands of sessions' pins made
        # every store walk them all). A policy may put a queue of its own here (the calls
        # used: in, iter, pop, setdefault, move_to_end, clear).
        self._leaves: Any = OrderedDict()
        self._pins: Counter[str] = Counter()  # key -> number of holders pinning it
        self._pinned_bytes = 0
        self._bytes = 0
        self._counts = ctx.counters.scope(self.name, "hits", "misses", "puts", "evictions",
                                          "share_evictions")
        # Tenants' arena bytes (whole allocation units, as the arena counts them), and the
        # tenants over their share (`_share`); a share of 1 tracks nothing.
        fraction = ctx.config.tenant_max_fraction
        # Staging (another role) holds loads in flight only: plain LRU.
        shared = fraction < 1 and self.name == CPU
        self._share = int(fraction * ctx.allocator.size) if shared else None
        self._tenant_bytes: dict[str, int] = {}
        self._over: set[str] = set()
        self._closed = False

    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                if k.key not in self._entries:
                    break
                n += 1
            return n

    def first_held(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            return next((i for i, k in enumerate(keys) if k.key in self._entries), -1)

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        with self._lock:
            out: list[MemoryObj] = []
            for k in keys:
                entry = self._entries.get(k.key)
                # Same key string but other tokens can only be a digest collision: a miss.
                if entry is None or entry[0].tokens != k.tokens:
                    self._counts.inc("misses")
                    break
                out.append(entry[1].retain())
            self._counts.inc("hits", len(out))
            if out:
                self._on_hit(keys[: len(out)])
            return out

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        if len(keys) != len(objs):
            raise ValueError(f"keys and objs differ in length: {len(keys)} != {len(objs)}")
        with self._lock:
            if self._closed:
                return 0
            # Tenants' bytes added once per tenant a batch (`_over` is read by evictions only,
            # none of which happens in here).
            added: dict[str, int] | None = None if self._share is None else {}
            for k, obj in zip(reversed(keys), reversed(objs)):
                old = self._drop_locked(k.key)
                if old is not None:
                    old[1].release()
                self._entries[k.key] = (k, obj.retain())
                self._bytes += obj.nbytes
                if added is not None:
                    added[k.salt] = added.get(k.salt, 0) - (-obj.nbytes // ALIGN) * ALIGN
                if k.key in self._pins:
                    self._pinned_bytes += obj.nbytes
                self._sync_leaf(k.key)
                if k.prev is not None:
                    self._children[k.prev] = self._children.get(k.prev, 0) + 1
                    self._leaves.pop(k.prev, None)
            if added:
                for salt, nbytes in added.items():
                    self._tenant_held(salt, nbytes)
            self._on_put(keys)
            self._counts.inc("puts", len(keys))
            return len(keys)

    def pin(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                entry = self._entries.get(k.key)
                if entry is None:
                    break
                if not self._pins[k.key]:
                    self._pinned_bytes += entry[1].nbytes
                    self._leaves.pop(k.key, None)
                self._pins[k.key] += 1
                n += 1
            return n

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for k in keys:
                left = self._pins[k.key] - 1
                if left > 0:
                    self._pins[k.key] = left
                    continue
                del self._pins[k.key]
                entry = self._entries.get(k.key)
                if entry is not None:
                    self._pinned_bytes -= entry[1].nbytes
                    self._sync_leaf(k.key)

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_bytes

    def tenant_bytes(self) -> dict[str, int]:
        """A copy of the arena bytes each tenant (its salt, "" unsalted) holds; empty while
        the share is off (`tenant_max_fraction: 1` counts nothing) and for staging."""
        with self._lock:
            return dict(self._tenant_bytes)

    def keys_of(self, salt: str) -> list[ChunkKey]:
        """The keys of every chunk tenant `salt` holds here, a snapshot (one walk of the
        entries under the lock: for an operator's purge, not the serving path)."""
        with self._lock:
            return [k for k, _ in self._entries.values() if k.salt == salt]

    def pop_lru(self, nbytes: int) -> list[tuple[ChunkKey, MemoryObj]]:
        out: list[tuple[ChunkKey, MemoryObj]] = []
        freed = 0
        with self._lock:
            while freed < nbytes:
                # Leaves only (no holes, nothing pinned), least recent first, skipping chunks
                # in use right now; evicting a leaf makes its parent the next one.
                # A share walk only while a tenant is over its share beside another.
                victim = (self._over_share_leaf()
                          if self._over and len(self._tenant_bytes) > 1 else None)
                if victim is None:
                    victim = self._first_leaf()
                else:
                    self._counts.inc("share_evictions")
                if victim is None:
                    break
                entry = self._drop_locked(victim, evicted=True)
                assert entry is not None
                freed += entry[1].nbytes
                out.append(entry)
            self._counts.inc("evictions", len(out))
        return out

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                entry = self._drop_locked(k.key)
                if entry is not None:
                    entry[1].release()
                    n += 1
            return n

    def _first_leaf(self) -> str | None:
        """The policy's first leaf not in use right now (None if none): the next victim."""
        return next((n for n in self._leaves if self._entries[n][1].refs == 1), None)

    def _over_share_leaf(self) -> str | None:
        """The policy's first evictable leaf of a tenant over its share, while another tenant
        holds chunks too; None if there is none (then the policy's first leaf of anyone goes).
        Walks past the leaves of tenants within their share only: nothing while none is over."""
        if not self._over or len(self._tenant_bytes) < 2:
            return None
        over, entries = self._over, self._entries
        return next((n for n in self._leaves
                     if entries[n][0].salt in over and entries[n][1].refs == 1), None)

    def _tenant_held(self, salt: str, nbytes: int) -> None:
        """Tenant `salt` holds `nbytes` more (or fewer, when negative); keeps `_over` exact.
        Only while a share is kept (`_share` set)."""
        assert self._share is not None
        held = self._tenant_bytes.get(salt, 0) + nbytes
        if held:
            self._tenant_bytes[salt] = held
        else:
            del self._tenant_bytes[salt]
        if held > self._share:
            self._over.add(salt)
        elif self._over:  # none over its share: the common case, no call
            self._over.discard(salt)

    def _on_put(self, keys: Sequence[ChunkKey]) -> None:
        """A policy's hook: `keys` (a prefix's next chunks) were just stored, each a new
        entry (a leaf where no child of it is cached)."""

    def _on_hit(self, keys: Sequence[ChunkKey]) -> None:
        """A policy's hook: `keys` (a prefix's leading chunks, all held) were just served. Here
        (LRU) they become the most recent, the first chunk newest (a prefix goes from its end);
        one call per batch, so a policy that keeps its own order pays no per-chunk dispatch."""
        entries, leaves = self._entries, self._leaves
        for k in reversed(keys):
            entries.move_to_end(k.key)
            if k.key in leaves:
                leaves.move_to_end(k.key)

    def _on_drop(self, name: str, evicted: bool) -> None:
        """A policy's hook: `name` left the tier (`evicted`: for room, else removed)."""

    def _drop_locked(self, name: str, evicted: bool = False,
                     ) -> tuple[ChunkKey, MemoryObj] | None:
        """Unlink an entry; the caller gets the tier's reference."""
        entry = self._entries.pop(name, None)
        if entry is not None:
            self._on_drop(name, evicted)
            self._leaves.pop(name, None)
            self._bytes -= entry[1].nbytes
            if self._share is not None:  # `_tenant_held`, inlined: a drop only lowers
                salt = entry[0].salt
                held = self._tenant_bytes.get(salt, 0) + (-entry[1].nbytes // ALIGN) * ALIGN
                if held:
                    self._tenant_bytes[salt] = held
                else:
                    del self._tenant_bytes[salt]
                if held <= self._share and self._over:
                    self._over.discard(salt)
            if name in self._pins:  # removed while pinned: its pins now hold nothing
                self._pinned_bytes -= entry[1].nbytes
            prev = entry[0].prev
            if prev is not None:
                left = self._children[prev] - 1
                if left:
                    self._children[prev] = left
                else:
                    del self._children[prev]
                    # A prefix's next chunk to go: evicted next, where the order is recency's.
                    if self._sync_leaf(prev) and self._parent_next:
                        self._leaves.move_to_end(prev, last=False)
        return entry

    def _sync_leaf(self, name: str) -> bool:
        """Keep `name` in `_leaves` iff it is cached, childless and unpinned; whether it is."""
        if name in self._entries and not self._children.get(name) and name not in self._pins:
            self._leaves.setdefault(name, None)
            return True
        self._leaves.pop(name, None)
        return False

    def stats(self) -> dict[str, float]:
        with self._lock:
            gauges = {"entries": len(self._entries), "bytes": self._bytes,
                      "pinned_bytes": self._pinned_bytes}
        return {**self._counts.snapshot(declared=True), **gauges}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries, self._entries = self._entries, type(self._entries)()
            self._children.clear()
            self._leaves.clear()
            self._bytes = 0
            self._tenant_bytes.clear()
            self._over.clear()
        for _, obj in entries.values():
            obj.release()
