"""The disk tier's in-memory index: which records exist, how big they are, which are being read,
whose they are, and which to evict. No file I/O here (a record's owner is read by the
`identify` function it is given): `DiskBackend` does the files and holds the lock that makes
an index change and its file change one step.

A directory may be shared by servers of other models or tenants. Each record's owner (its key's
namespace and model) is learned as the record is written or read, or from its header by a
background scan; the cap counts, and eviction takes, only records of the owners this tier
writes for (`claim`). A record whose owner is not known yet is never evicted.

An owner string may end in `TENANT_SEP` and a tenant's tag (`owners.owner_of`: a salted
record). With a share (`tenant_max_fraction` < 1), while two or more tenants hold records this
tier counts, a write over the cap evicts the least recently used records of tenants holding
more than that share of the cap first, then the least recently used of anyone, as the CPU tier
does (docs/policies.md). Under `eviction_policy: lfuda` the order is `DiskFrequency`'s (leaves
by uses with dynamic aging) instead of LRU's; the share and every other rule are the same."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvtier.backends.disk.frequency import DiskFrequency
from kvtier.config.names import LFUDA

__all__ = ["DiskIndex", "IDENTIFY_PER_WRITE", "TENANT_SEP"]

TENANT_SEP = "\0"  # between an owner and its tenant's tag: in neither a key component nor a tag

IDENTIFY_PER_WRITE = 64  # record headers a write may read to find its own oldest records
NOTED_USES = 1024  # uses noted between two index changes, at most (past it the oldest go):
# a bound on the memory they hold and on the hashing that applying them costs


class DiskIndex:
    """Record names (file stems) to sizes in LRU order, least recent first, against a byte cap;
    evicted in that order, or in `DiskFrequency`'s under `lfuda`.

    Not thread-safe: the caller serializes every call (the backend's lock), except `note`.

    Args:
        capacity: the cap in bytes (`max_local_disk_size`).
        identify: a record's owner, read from its file (the caller's I/O).
        name_of: a noted key's record name (`note` takes keys: the backend's `ChunkKey`s).
        share: the largest share of the cap one tenant holds while others want room
            (`tenant_max_fraction`; 1: none).
        policy: `eviction_policy`; `lfuda` evicts by `DiskFrequency`, any other by LRU.
    """

    def __init__(self, capacity: int,
                 identify: Callable[[str], str | None] = lambda name: None,
                 name_of: Callable[[Any], str] = str, share: float = 1.0, policy: str = ""):
        self.capacity = capacity
        self._freq = DiskFrequency() if policy == LFUDA else None
        self._share = int(share * capacity) if share < 1 else None
        self._tenants: dict[str, str] = {}  # name -> tenant tag ("" unsalted), owner known
        self.tenant_bytes: dict[str, int] = {}  # tenant -> bytes of its records of `mine`
        self._identify = identify
        self._name_of = name_of
        self._noted: deque[Sequence[Any]] = deque(maxlen=NOTED_USES)  # keys, by `note`
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0  # indexed records
        self._owners: dict[str, str] = {}  # name -> owner, where known
        self.mine: set[str] = set()  # the owners this tier writes for
        self.own_bytes = 0  # indexed records of `mine`: what the cap counts
        self.reserved = 0  # writes in flight count against the cap
        self._readers: Counter[str] = Counter()
        self._clock = 0  # the newest mtime handed out or found (ns)

    def __contains__(self, name: str) -> bool:
        return name in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def names(self) -> list[str]:
        """Indexed record names, least recently used first."""
        self.apply_noted()
        return list(self._sizes)

    def load(self, found: Iterable[tuple[int, str, int]]) -> None:
        """Index `(mtime_ns, name, size)` records found on disk, oldest first."""
        for mtime, name, size in found:
            self.put(name, size)
            self._clock = max(self._clock, mtime)

    @property
    def chained(self) -> bool:
        """Whether `put` uses a record's parent (its eviction order keeps prefixes whole)."""
        return self._freq is not None

    def put(self, name: str, size: int, owner: str | None = None,
            parent: str | None = None) -> None:
        """Index record `name` of `size` bytes as the most recently used (replacing any), of
        `owner` when known, the chunk after record `parent` when known (see `chained`)."""
        self.apply_noted()  # uses noted before this put are older
        self.forget(name)
        self._sizes[name] = size
        self.bytes += size
        if self._freq is not None:
            self._freq.add(name, parent)
        if owner is not None:
            self.set_owner(name, owner)

    def adopt(self, name: str, size: int, owner: str | None = None) -> bool:
        """Index a record found on disk but not in the index (another process wrote it);
        False if it was indexed already (its owner is noted either way)."""
        if name in self._sizes:
            if owner is not None:
                self.set_owner(name, owner)
            return False
        self.put(name, size, owner)
        return True

    def forget(self, name: str, evicted: bool = False) -> None:
        """Unindex record `name` (`evicted`: for room, which the eviction order learns from)."""
        size = self._sizes.pop(name, None)
        if size is not None:
            if self._freq is not None:
                self._freq.drop(name, evicted)
            self.bytes -= size
            tenant = self._tenants.pop(name, "")
            if self._owners.pop(name, None) in self.mine:
                self.own_bytes -= size
                self._tenant_held(tenant, -size)

    def set_owner(self, name: str, owner: str) -> None:
        """Record `name` (indexed) belongs to `owner` (and to the tenant it names, if any)."""
        owner, _, tenant = owner.partition(TENANT_SEP)
        old = self._owners.get(name)
        if name not in self._sizes or (old == owner and self._tenants.get(name) == tenant):
            return
        size = self._sizes[name]
        if old in self.mine:
            self._tenant_held(self._tenants[name], -size)
        if owner in self.mine:
            self._tenant_held(tenant, size)
        self._owners[name] = owner
        self._tenants[name] = tenant
        self.own_bytes += size * ((owner in self.mine) - (old in self.mine))

    def claim(self, owner: str) -> None:
        """This tier writes for `owner` (any tenant of it): its records count against the cap
        and may be evicted (a walk of the index, once per owner)."""
        owner = owner.partition(TENANT_SEP)[0]
        if owner in self.mine:
            return
        self.mine.add(owner)
        for name, of in self._owners.items():
            if of == owner:
                self.own_bytes += self._sizes[name]
                self._tenant_held(self._tenants[name], self._sizes[name])

    def _tenant_held(self, tenant: str, nbytes: int) -> None:
        if self._share is None:
            return
        held = self.tenant_bytes.get(tenant, 0) + nbytes
        if held:
            self.tenant_bytes[tenant] = held
        else:
            del self.tenant_bytes[tenant]

    @property
    def unknown(self) -> int:
        """How many indexed records have no known owner yet."""
        return len(self._sizes) - len(self._owners)

    def unknown_owners(self, limit: int | None = None) -> list[str]:
        """Indexed records whose owner is not known yet, least recently used first (the
        first `limit` of them)."""
        out: list[str] = []
        for name in self._sizes:
            if limit is not None and len(out) >= limit:
                break
            if name not in self._owners:
                out.append(name)
        return out

    def _identify_oldest(self) -> None:
        """Identify the least recently used records whose owner is not known yet (the
        background scan has not reached them): a write over the cap right after a restart
        must find and count its own old records."""
        for name in self.unknown_owners(IDENTIFY_PER_WRITE):
            if (owner := self._identify(name)) is not None:
                self.set_owner(name, owner)

    def _evictable(self, name: str) -> bool:
        return not self._readers[name] and self._owners.get(name) in self.mine

    def touch(self, names: Iterable[str], use: bool = True) -> None:
        """Mark `names` used, the first as the most recent (a prefix is used front to back, and
        its first chunk is the last to evict); without `use`, reordered only (a batch just
        `put`, its store already counted as a use)."""
        self.apply_noted()  # uses noted before this one are older
        self._used(list(names), use)

    def _used(self, names: list[str], use: bool = True) -> None:
        for name in reversed(names):
            if name in self._sizes:
                self._sizes.move_to_end(name)
        if use and self._freq is not None:
            self._freq.use(names)

    def note(self, keys: Sequence[Any]) -> None:
        """`touch` the records of `keys` (named by `name_of`) later: safe without the caller's
        lock (a deque's append is atomic), so a use served by a faster tier never waits on a
        write holding it, nor hashes names. Applied, oldest first, before the order is next
        read or changed."""
        self._noted.append(keys)

    def apply_noted(self) -> None:
        """Apply what `note` noted (only the lock's holder takes from the deque, and appends
        only lengthen it, so it is never found empty here after a check)."""
        while self._noted:
            self._used([self._name_of(key) for key in self._noted.popleft()])

    def stamps(self, n: int) -> list[int]:
        """`n` fresh, strictly decreasing mtimes (ns): a batch's first chunk is its newest."""
        t = max(time.time_ns(), self._clock + 1)
        self._clock = t + n - 1
        return [t + n - 1 - i for i in range(n)]

    def pin(self, name: str) -> None:
        """`name` is being read: eviction skips it until `unpin`."""
        self._readers[name] += 1

    def unpin(self, name: str) -> None:
        self._readers[name] -= 1
        if not self._readers[name]:
            del self._readers[name]

    def _order(self, taken: set[str]) -> Iterable[str]:
        """Every record in eviction order (LRU's, or `DiskFrequency`'s leaves, a parent after
        a child in `taken`); the caller skips those it may not evict."""
        return self._sizes if self._freq is None else self._freq.walk(taken)

    def victims(self, need: int, shrink: int = 1) -> list[str] | None:
        """The first records in eviction order of `mine`, none being read, whose eviction lets a
        write of `need` bytes fit under the cap (never more than `shrink` x `need` bytes of
        them: a tier over its cap shrinks by a bounded amount per write); None if it cannot
        fit. Picks only: the caller deletes them and `forget`s each."""
        if need > self.capacity:
            return None
        self.apply_noted()
        if self.unknown and self.bytes + self.reserved + need > self.capacity:
            self._identify_oldest()  # this tier's own may be among them
        over = self.own_bytes + self.reserved + need - self.capacity
        fit = min(over, need)  # what must go for this write to fit
        over = min(over, max(1, shrink) * need)
        chosen = self._over_share(over) if over > 0 else []
        taken = set(chosen)
        over -= sum(self._sizes[n] for n in chosen)
        fit -= sum(self._sizes[n] for n in chosen)
        for name in self._order(taken):
            if over <= 0:
                break
            if name not in taken and self._evictable(name):
                size = self._sizes[name]
                chosen.append(name)
                taken.add(name)
                over -= size
                fit -= size
        return None if fit > 0 else chosen

    def _over_share(self, nbytes: int) -> list[str]:
        """The first evictable records in eviction order of tenants over their share, while
        another tenant holds records too, up to `nbytes` and only while each stays over it."""
        share = self._share
        if share is None or len(self.tenant_bytes) < 2:
            return []
        held = {t: b for t, b in self.tenant_bytes.items() if b > share}
        chosen: list[str] = []
        taken: set[str] = set()
        for name in self._order(taken):
            if nbytes <= 0 or not held:
                break
            tenant = self._tenants.get(name)
            if tenant in held and self._evictable(name):
                size = self._sizes[name]
                chosen.append(name)
                taken.add(name)
                nbytes -= size
                held[tenant] -= size
                if held[tenant] <= share:
                    del held[tenant]
        return chosen

    def oldest(self, nbytes: int) -> list[str]:
        """The first records in eviction order of `mine`, none being read, that hold at least
        `nbytes` (all of them when they hold less): what a full disk evicts. Picks only, as
        `victims`."""
        self.apply_noted()
        chosen: list[str] = []
        taken: set[str] = set()
        for name in self._order(taken):
            if nbytes <= 0:
                break
            if self._evictable(name):
                chosen.append(name)
                taken.add(name)
                nbytes -= self._sizes[name]
        return chosen

    def check(self) -> None:
        """Raise `AssertionError` unless the byte count matches the index (for tests)."""
        assert self.bytes == sum(self._sizes.values()), "byte count drifted"
        assert self.own_bytes == sum(self._sizes[n] for n, o in self._owners.items()
                                     if o in self.mine), "own byte count drifted"
        if self._share is not None:
            by_tenant: Counter[str] = Counter()
            for name, owner in self._owners.items():
                if owner in self.mine:
                    by_tenant[self._tenants[name]] += self._sizes[name]
            assert self.tenant_bytes == dict(by_tenant), "tenant byte counts drifted"
        assert self.reserved >= 0, "negative reservation"
        if self._freq is not None:
            self._freq.check(set(self._sizes))
