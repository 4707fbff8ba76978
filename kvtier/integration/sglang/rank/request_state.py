"""One request's kvtier state on one rank, from its first match to its store or abort.

SGLang calls kvtier about a waiting request many times (a match at every scheduler step, a
prefetch check, the admission, the checkpoint that stores it). What those calls learn about it
lives in one `RequestState`, which a `RequestTable` creates at the first call and forgets in
one place (`forget`: the request finished, or went away), with a bound for requests SGLang
never tells kvtier about again. The blender keeps its own per-request objects in a table of the
same kind (`blending.blender`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from kvtier.engine import Prefetch, Prefix
from kvtier.integration.sglang.blending.blend_chains import SegmentHits
from kvtier.integration.sglang.boundary.sglang_views import RadixKeyView

__all__ = ["Loaded", "Promise", "RankRequests", "RequestState", "RequestTable", "VerifyCut"]

MAX_REQUESTS = 4096  # states kept for requests with no load running (see `RequestTable`)
S = TypeVar("S")


class Promise(NamedTuple):
    """The host hit a match reported, for the admission to load: tokens `[device_len, end)`
    of `key`, from the CPU tier, or blended from `hits`."""

    key: RadixKeyView
    device_len: int
    end: int
    hits: SegmentHits | None


class Loaded(NamedTuple):
    """What the admission loaded (up to token `end`; `computed` of them a blend computed),
    until the request's prefill runs."""

    end: int
    computed: int


class VerifyCut(NamedTuple):
    """A request computed to verify the tiers: its store compares from token `start` on;
    `loaded`: the tokens before it came from the tiers (`verify_scope: tail`)."""

    start: int
    loaded: bool


@dataclass(slots=True)
class RequestState:
    """What kvtier knows of one request on this rank.

    `prefix`: its tokens, salt and key chain, hashed once at its first match and dropped once
    loaded; `prefetch`: its background load into the CPU tier, until it may be admitted
    (`checked`: asked about once); `verify`: set when it is computed to verify the tiers;
    `promise`: the host hit its last match reported; `loaded`: what its admission loaded;
    `found`: the leading tokens its admission found in the tiers (its store need not write
    them again where no CPU tier can tell).
    """

    prefix: Prefix | None = None
    prefetch: Prefetch | None = None
    checked: bool = False
    verify: VerifyCut | None = None
    promise: Promise | None = None
    loaded: Loaded | None = None
    found: int = 0


class RequestTable(Generic[S]):
    """Request id -> its state (`make()` at the first call), on one rank (SGLang's scheduler
    thread only).

    Bounded: past `limit` states, the oldest half of those not `held` are dropped (requests
    SGLang never asked about again: their state is cheap to rebuild, and a dropped promise
    only makes an admission compute what it would have loaded). A `held` state (a load is
    running for it) stays until it is admitted or cancelled: SGLang's waiting queue bounds
    those.
    """

    def __init__(self, make: Callable[[], S], held: Callable[[S], bool],
                 limit: int = MAX_REQUESTS):
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit}")
        self._make = make
        self._held = held
        self._limit = limit
        self._states: dict[str, S] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def __iter__(self) -> Iterator[S]:
        return iter(list(self._states.values()))

    def get(self, rid: str | None) -> S | None:
        return None if rid is None else self._states.get(rid)

    def open(self, rid: str) -> S:
        """Request `rid`'s state, created at the first call about it."""
        state = self._states.get(rid)
        if state is None:
            if len(self._states) >= self._limit:
                self._shed()
            state = self._states[rid] = self._make()
        return state

    def forget(self, rid: str) -> S | None:
        """Drop request `rid`'s state (it finished, or went away); returns it."""
        return self._states.pop(rid, None)

    def clear(self) -> None:
        self._states.clear()

    def _shed(self) -> None:
        """Make room: drop the older half of the states not held."""
        idle = [rid for rid, s in self._states.items() if not self._held(s)]
        for rid in idle[:max(1, len(idle) // 2)]:
            del self._states[rid]


class RankRequests(RequestTable[RequestState]):
    """The adapter's and the radix cache's `RequestState`s; a running prefetch holds one.
    Prefetches are set and taken through `add_prefetch` / `end_prefetch`, so the idle loop's
    `prefetching()` is a count, not a scan."""

    def __init__(self, limit: int = MAX_REQUESTS):
        super().__init__(RequestState, lambda s: s.prefetch is not None, limit)
        self._prefetching: set[str] = set()  # request ids whose state holds a prefetch

    def add_prefetch(self, rid: str, prefetch: Prefetch) -> None:
        """Request `rid`'s prefetch started: its admission waits for it."""
        self.open(rid).prefetch = prefetch
        self._prefetching.add(rid)

    def end_prefetch(self, rid: str) -> Prefetch | None:
        """Take request `rid`'s prefetch from its state (it was admitted), if it has one."""
        state = self.get(rid)
        prefetch = None if state is None else state.prefetch
        if state is not None:
            state.prefetch, state.checked = None, False
        self._prefetching.discard(rid)
        return prefetch

    def forget(self, rid: str) -> RequestState | None:
        self._prefetching.discard(rid)
        return super().forget(rid)

    def clear(self) -> None:
        self._prefetching.clear()
        super().clear()

    def prefetching(self) -> int:
        """Requests whose prefetch still decides their admission."""
        return len(self._prefetching)

    def take_prefetches(self) -> list[Prefetch]:
        """Every running prefetch, each taken from its state (the rank closes)."""
        return [p for rid in list(self._prefetching) if (p := self.end_prefetch(rid))]

    def drop_loads(self) -> None:
        """Forget every promise and load (SGLang emptied its pool: `/flush_cache`)."""
        for state in self:
            state.promise = None
            state.loaded = None
