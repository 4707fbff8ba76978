"""Predicted reuse (an experiment, issue 69): a plain-Python model of the CPU tier whose
eviction guesses each block's next use from its own past gaps and evicts the leaf expected
back last, an online stand-in for Belady's MIN. Not a product policy: it keeps every block's
history forever (ghost metadata without bound), which the tier could not.

The tier's rules are `bounds.leaf_lru`'s: a request's hit is its leading blocks present on
arrival; the blocks from its first miss on are allocated first (each allocation that finds the
cache full evicts one leaf, a block no cached block follows), then stored; a request longer
than the cache stores what it could allocate. Time is the request's index in the trace.

A variant is GAP followed by `+`-joined flags:

- GAP, a block used at least twice: its next use is predicted at last use + `last` (the last
  gap), `ewma` (gaps averaged, weight 1/2 to the newest) or `mean` (time since its first use
  over its uses); `oracle` scores by the true next use (a reference, not online), `+noiseF`
  times a lognormal error whose sigma is ln F (F=2: 68% of guesses within a factor of 2);
- a block used once so far: predicted at last use + the trace's running mean of first reuse
  gaps (`+mean`, the default), or never (`+inf`: such blocks go first, the oldest first);
- a block past its predicted use is scored by its age (its next use is at least that far);
  `+late` scores it above every block still due (a missed prediction marks it dead);
- `+rate`: the score is the predicted gap itself, not the time left to the next use (a
  memoryless reading: only how often a block returns counts);
- `+admit`: a block whose predicted next use lies beyond the cache's horizon (the mean age of
  the last 256 blocks evicted) is not stored, nor anything after it in its request.

Victims are the highest-scored of 32 leaves drawn at random (fixed seed), so runs repeat.

    python -m benchmarks.traces.predicted --trace FILE --capacity-tokens 1e5,1e6,3e6,1e7 \\
        --variant last+mean,ewma+inf+admit [--limit N] [--gaps] [--no-bounds]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import deque
from pathlib import Path

from benchmarks.traces.bounds import _next_uses, belady, leaf_lru
from benchmarks.traces.trace import BLOCK, Request, hit_tokens, input_tokens, load

__all__ = ["predicted"]

SAMPLE = 32  # leaves scored per eviction
NEVER = float(1 << 60)  # the score of a block never predicted back


def predicted(requests: list[Request], capacity: int, variant: str = "last+mean") -> int:
    """Tokens hit over `capacity` blocks under predicted-reuse eviction `variant` (module
    docstring). Deterministic for a given trace, capacity and variant."""
    parts = variant.split("+")
    gap_rule = parts[0]
    noise = [float(p[5:]) for p in parts[1:] if p.startswith("noise")]
    parts = [p for p in parts if not p.startswith("noise")]
    sigma = math.log(noise[0]) if noise else 0.0
    once = "inf" if "inf" in parts else "mean"
    admit, rate, late = "admit" in parts, "rate" in parts, "late" in parts
    if gap_rule not in ("last", "ewma", "mean", "oracle") or not set(parts[1:]) <= {
            "mean", "inf", "admit", "rate", "late"}:
        raise ValueError(f"unknown variant {variant!r}")
    nxt = _next_uses(requests) if gap_rule == "oracle" else None
    rng = random.Random(0)
    last: dict[int, int] = {}  # block -> request index of its last use
    first: dict[int, int] = {}  # block -> request index of its first use
    uses: dict[int, int] = {}
    gap: dict[int, float] = {}  # block -> predicted gap (blocks used twice or more)
    true_next: dict[int, float] = {}
    parent: dict[int, int | None] = {}
    children: dict[int, int] = {}
    present: set[int] = set()
    leaves: list[int] = []
    where: dict[int, int] = {}  # leaf -> its index in `leaves`
    first_gaps = [0.0, 0]  # sum and count of first reuse gaps seen
    ages: deque[int] = deque(maxlen=256)

    def add_leaf(b: int) -> None:
        if b not in where:
            where[b] = len(leaves)
            leaves.append(b)

    def drop_leaf(b: int) -> None:
        i = where.pop(b, None)
        if i is not None:
            tail = leaves.pop()
            if tail != b:
                leaves[i] = tail
                where[tail] = i

    def ahead(b: int, now: int) -> float:
        """How far ahead the block's next use is expected (larger: evicted sooner)."""
        if nxt is not None:
            return true_next[b] - now
        g = gap.get(b)
        if g is None:
            if once == "inf" or not first_gaps[1]:
                return NEVER + (now - last[b])
            g = first_gaps[0] / first_gaps[1]
        if rate:
            return g
        due = last[b] + g - now
        if due >= 0:
            return due
        return (NEVER / 2 if late else 0.0) + (now - last[b])

    def evict(now: int) -> None:
        pool = leaves if len(leaves) <= SAMPLE else rng.sample(leaves, SAMPLE)
        victim = max(pool, key=lambda b: ahead(b, now))
        ages.append(now - last[victim])
        present.discard(victim)
        drop_leaf(victim)
        up = parent[victim]
        if up is not None:
            children[up] -= 1
            if not children[up] and up in present:
                add_leaf(up)

    hits = 0
    for now, req in enumerate(requests):
        blocks = req.blocks
        n = 0
        while n < len(blocks) and blocks[n] in present:
            n += 1
        hits += hit_tokens(req, n)
        for i, b in enumerate(blocks):
            parent.setdefault(b, blocks[i - 1] if i else None)
            seen = last.get(b)
            if seen is not None:
                g = now - seen
                if b not in gap:
                    first_gaps[0] += g
                    first_gaps[1] += 1
                    gap[b] = g
                elif gap_rule == "mean":
                    gap[b] = (now - first[b]) / uses[b]
                elif gap_rule == "ewma":
                    gap[b] = 0.5 * g + 0.5 * gap[b]
                else:
                    gap[b] = g
            last[b] = now
            first.setdefault(b, now)
            uses[b] = uses.get(b, 0) + 1
            if nxt is not None:  # the true distance, times a lognormal error when noisy
                true_next[b] = now + (nxt[now][i] - now) * math.exp(rng.gauss(0.0, sigma))
        todo = list(blocks[n:])
        if admit and len(ages) == ages.maxlen:
            horizon = sum(ages) / len(ages)
            keep = 0
            while keep < len(todo) and ahead(todo[keep], now) <= horizon:
                keep += 1
            todo = todo[:keep]
        held = 0
        for _ in todo:
            if len(present) + held >= capacity:
                if not leaves:
                    break
                evict(now)
            held += 1
        for b in reversed(todo[:held]):
            if b in present:  # cannot happen (parents outlive children); guard the counts
                continue
            present.add(b)
            if not children.get(b):
                add_leaf(b)
            up = parent[b]
            if up is not None:
                children[up] = children.get(up, 0) + 1
                drop_leaf(up)
    return hits


def gap_ratios(requests: list[Request]) -> list[float]:
    """How well a block's last gap predicts its next one: each reuse's gap over the block's
    previous gap, sorted (a block's third use on). For independent exponential gaps (a
    memoryless reuse) the quartiles would be 1/3 and 3."""
    last: dict[int, int] = {}
    prev: dict[int, int] = {}
    out: list[float] = []
    for now, req in enumerate(requests):
        for b in req.blocks:
            if b in last:
                g = now - last[b]
                if b in prev:
                    out.append(g / max(prev[b], 1))
                prev[b] = g
            last[b] = now
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--capacity-tokens", default="1e5,1e6,3e6,1e7")
    ap.add_argument("--variant", default="last+mean")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--no-bounds", action="store_true", help="skip the LRU and Belady columns")
    ap.add_argument("--gaps", action="store_true", help="print gap/previous-gap deciles too")
    args = ap.parse_args()
    requests = load(args.trace, args.limit)
    total = input_tokens(requests)
    if args.gaps:
        r = gap_ratios(requests)
        tiles = " ".join(f"{r[int(q * len(r))]:.2f}" for q in (.1, .25, .5, .75, .9))
        print(f"{args.trace.stem}: {len(r)} reuses, next gap / last gap at the 10/25/50/75/90th "
              f"percentiles: {tiles}, within 0.5-2x: {sum(.5 <= x <= 2 for x in r) / len(r):.0%}")
    for cap in (int(float(c)) for c in args.capacity_tokens.split(",")):
        blocks = cap // BLOCK
        lru = leaf_lru(requests, blocks) / total
        row = f"{args.trace.stem} {cap:.0e} LRU {lru:.2%}"
        if not args.no_bounds:
            row += f" Belady {belady(requests, blocks) / total:.2%}"
        for v in args.variant.split(","):
            t = time.perf_counter()
            rate = predicted(requests, blocks, v) / total
            row += f" | {v} {rate:.2%} ({rate / lru:.3f}x, {time.perf_counter() - t:.0f}s)"
        print(row, flush=True)


if __name__ == "__main__":
    main()
