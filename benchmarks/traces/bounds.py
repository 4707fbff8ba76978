"""The caches a kvtier replay is read against, in plain Python over block ids (one block, one
unit of capacity): what no capacity limit gives, LRU as kvtier's CPU tier evicts, and Belady's
offline optimum. Each returns the tokens hit over the requests (`trace.hit_tokens`): a
request's hit is its leading blocks present when it arrives, then its blocks are offered."""

from __future__ import annotations

import heapq
from collections import OrderedDict

from benchmarks.traces.trace import Request, hit_tokens

__all__ = ["belady", "infinite", "leaf_lru"]


def infinite(requests: list[Request]) -> int:
    """Tokens hit with no capacity limit: every block stays once stored."""
    seen: set[int] = set()
    hits = 0
    for req in requests:
        n = _leading(req.blocks, seen)
        hits += hit_tokens(req, n)
        seen.update(req.blocks[n:])
    return hits


def leaf_lru(requests: list[Request], capacity: int) -> int:
    """Tokens hit by LRU over `capacity` blocks with the CPU tier's rules
    (`kvtier.backends.cpu`), step for step as the replay drives it:

    - a hit touches the request's leading blocks (only the deepest can be a leaf);
    - the blocks from the first miss on are allocated one at a time (each allocation that
      finds the cache full evicts the least recently used leaf: a block no cached block
      follows), then put from the last to the first, so the first is the most recent;
    - a block whose last cached child goes becomes a leaf evicted next (a chain is taken
      from its end before another chain is touched);
    - when no leaf is left (a request longer than the cache), the store stops there.
    """
    present: set[int] = set()
    leaves: OrderedDict[int, None] = OrderedDict()  # least recent first
    children: dict[int, int] = {}  # block -> cached blocks whose parent it is
    parent: dict[int, int | None] = {}

    def drop(block: int) -> None:
        present.discard(block)
        leaves.pop(block, None)
        up = parent[block]
        if up is not None:
            left = children[up] - 1
            if left:
                children[up] = left
            else:
                del children[up]
                if up in present:
                    leaves[up] = None
                    leaves.move_to_end(up, last=False)

    hits = 0
    for req in requests:
        blocks = req.blocks
        for i, block in enumerate(blocks):
            parent.setdefault(block, blocks[i - 1] if i else None)
        n = _leading(blocks, present)
        hits += hit_tokens(req, n)
        for block in reversed(blocks[:n]):
            if block in leaves:
                leaves.move_to_end(block)
        todo = blocks[n:]
        held = 0
        for _ in todo:  # the allocations, before anything is put
            if len(present) + held >= capacity:
                if not leaves:
                    break
                drop(next(iter(leaves)))
            held += 1
        for block in reversed(todo[:held]):
            if block in present:
                drop(block)
            present.add(block)
            if not children.get(block):
                leaves.setdefault(block, None)
            up = parent[block]
            if up is not None:
                children[up] = children.get(up, 0) + 1
                leaves.pop(up, None)
    return hits


def belady(requests: list[Request], capacity: int) -> int:
    """Tokens hit by Belady's MIN over `capacity` blocks: each offered block that finds the
    cache full either replaces the cached block used again farthest in the future or, when it
    is itself that block, is not stored (the offline optimum may decline to store).

    Prefix chains: a request that uses a block uses its parent, so a parent's next use never
    comes after its child's; ties go to the deeper block, hence a cached block's parent is
    always cached (no useless orphan is ever kept) and the cache's block hits are all leading
    hits. MIN maximises block hits, which bound leading hits for any cache, so this is the
    optimum of the prefix hit rate up to two simplifications: hits count whole blocks (a
    request's partial last block weighs less), and a request's blocks are judged at its
    arrival (MIN could evict one of a request's own blocks while storing it only when the
    request is longer than the cache)."""
    nxt = _next_uses(requests)
    cached: dict[int, int] = {}  # block -> its next use (request index)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block); stale entries skipped
    hits = 0
    for i, req in enumerate(requests):
        blocks = req.blocks
        hits += hit_tokens(req, _leading(blocks, cached))
        for depth, (block, use) in enumerate(zip(blocks, nxt[i])):
            if block not in cached and len(cached) >= capacity:
                while cached.get(heap[0][2]) != -heap[0][0]:  # the latest entry of a block
                    heapq.heappop(heap)
                if (use, depth) >= (-heap[0][0], -heap[0][1]):
                    continue  # this block is the one used farthest ahead: not stored
                del cached[heapq.heappop(heap)[2]]
            cached[block] = use
            heapq.heappush(heap, (-use, -depth, block))
        if len(heap) > 4 * capacity + 1024:  # drop the stale entries now and then
            heap = [e for e in heap if cached.get(e[2]) == -e[0]]
            heapq.heapify(heap)
    return hits


def _next_uses(requests: list[Request]) -> list[list[int]]:
    """For each request and each of its blocks, the index of the next request using it
    (`len(requests)` for none)."""
    last: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    never = len(requests)
    for i in range(len(requests) - 1, -1, -1):
        blocks = requests[i].blocks
        out[i] = [last.get(b, never) for b in blocks]
        for b in blocks:
            last[b] = i
    return out


def _leading(blocks: tuple[int, ...], present: set[int] | dict[int, int]) -> int:
    n = 0
    for block in blocks:
        if block not in present:
            break
        n += 1
    return n
