"""What became of the lower-tier writes: written, still pending, or lost and why.

Each `TierWriter` counts every chunk it was handed exactly once, as written (`writes`), held
already (`write_present`), or lost; a lost chunk under one reason below and under `LOST`, the
total. A stop reads them here (`write_backlog`), so its report names every write lost since
the start, by tier and reason, not only those still queued at its deadline.
"""

from __future__ import annotations

from typing import NamedTuple

from kvtier.metrics import Counters

__all__ = ["WriteLoss", "WriteBacklog", "write_backlog", "DROPPED", "FAILED", "ORPHANED",
           "CANCELLED", "LOST", "LOSS_REASONS"]

# Reasons a handed chunk is never written (each a counter `tier.reason`):
DROPPED = "write_dropped"  # refused at submit: the queue was full
FAILED = "write_failed"  # the tier did not take it: an error, a timeout, the tier down
ORPHANED = "write_orphans"  # skipped: its predecessor chunk is in no tier
CANCELLED = "write_cancelled"  # discarded unwritten: a detach, a close out of time
LOSS_REASONS = (DROPPED, FAILED, ORPHANED, CANCELLED)
LOST = "writes_lost"  # every one of them, once


class WriteLoss(NamedTuple):
    """The writes to one lower tier lost since the start, by reason; each chunk counted once."""

    tier: str
    queue_full: int
    failed: int
    orphaned: int
    cancelled: int

    @property
    def total(self) -> int:
        return self.queue_full + self.failed + self.orphaned + self.cancelled

    def __str__(self) -> str:
        parts = [f"{n} {why}" for n, why in ((self.failed, "failed"),
                                              (self.queue_full, "queue full"),
                                              (self.orphaned, "orphaned"),
                                              (self.cancelled, "cancelled")) if n]
        return f"{self.tier} {self.total} ({', '.join(parts)})" if parts else f"{self.tier} 0"


class WriteBacklog(NamedTuple):
    """Lower-tier writes over every tier, at one moment.

    `written`: written so far. `pending`: handed to a writer and not settled yet (queued, or
    in the write running now): what a stop that ends now loses on top of `lost`. `lost`: per
    tier that ever had a writer (detached ones too), since the start."""

    written: int
    pending: int
    lost: tuple[WriteLoss, ...]

    @property
    def lost_total(self) -> int:
        return sum(loss.total for loss in self.lost)


def write_backlog(counters: Counters, pending: int) -> WriteBacklog:
    """`WriteBacklog` from the writers' `counters` and their `pending` count (read that one
    first: a write settling in between is then counted twice, never hidden)."""
    counts = counters.snapshot(declared=True)
    written = sum(n for name, n in counts.items() if name.endswith(".writes"))
    tiers = sorted(name[:-len(LOST) - 1] for name in counts if name.endswith(f".{LOST}"))
    lost = []
    for tier in tiers:
        total = counts[f"{tier}.{LOST}"]
        failed, orphaned, cancelled = (counts.get(f"{tier}.{why}", 0)
                                       for why in (FAILED, ORPHANED, CANCELLED))
        # Queue-full drops by difference: a disk tier counts its own "no room" refusals under
        # `disk.write_dropped` too (they are `failed` here, from the writer's side).
        lost.append(WriteLoss(tier, total - failed - orphaned - cancelled, failed, orphaned,
                              cancelled))
    return WriteBacklog(written, pending, tuple(lost))
