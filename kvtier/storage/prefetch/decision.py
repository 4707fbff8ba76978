"""The adaptive policy's decision, load or recompute, as a pure function of the estimates:
`decide` picks the leading span of a request's lower-tier hits (`Span`s, in prefix order)
whose loading saves the most recompute time over its expected arrival, and says how long the
request waits for it (`Decision.deadline_s`). `LoadPlanner` (kvtier.storage.prefetch.planner)
applies it to live prefetches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from kvtier.storage.prefetch.estimates import PrefillSpeed, TierSpeed
from kvtier.storage.prefetch.handle import PREFETCH_WINDOW

__all__ = ["Span", "Decision", "decide", "DEADLINE_SLACK", "DEADLINE_GRACE_S",
           "DEADLINE_FLOOR_S"]

# A load may run this much past its expected arrival before the request goes on without the
# rest, and at least until half its saving is spent (a busy host's scheduling noise must not
# cut off a load that saves far more than it costs); never past the point where recomputing
# would have been done: see `Decision`.
DEADLINE_SLACK = 1.5
DEADLINE_GRACE_S = 0.005
# ... and never before this: a load planned to arrive in a few milliseconds (a small prompt
# from a local disk or Redis) must not become a recompute because a busy host ran its worker
# a few tens of milliseconds late; the most this costs over recomputing is this long, and only
# when a tier broke its own estimate.
DEADLINE_FLOOR_S = 0.05


class Span(NamedTuple):
    """Consecutive hit chunks that one lower tier holds."""

    tier: TierSpeed
    chunks: int
    chunk_bytes: int
    chunk_tokens: int


class Decision(NamedTuple):
    """What to load: `chunks` leading chunks of the spans, expected to have arrived after
    `expected_s`, saving `saved_s` of recompute. `deadline_s` is when the request stops
    waiting for them: after `expected_s` with some slack, or half of `saved_s` if later, and
    never after `saved_s` (a request that waited that long then recomputes: at most twice
    the recompute, and only when the tier broke its own estimate), except that it is at least
    `DEADLINE_FLOOR_S` (scheduling noise on a busy host). `guessed`: some tier of
    the load has no measured speed yet, so `expected_s` is a guess: the request does not
    wait for it (`LoadPlanner.plan` loads in the background)."""

    chunks: int
    tokens: int
    expected_s: float
    saved_s: float
    guessed: bool = False

    @property
    def deadline_s(self) -> float:
        slack = self.expected_s * DEADLINE_SLACK + DEADLINE_GRACE_S
        return max(DEADLINE_FLOOR_S, min(self.saved_s, max(slack, self.saved_s * 0.5)))


def decide(spans: Sequence[Span], prefill: PrefillSpeed, prompt_len: int) -> Decision:
    """The leading span of `spans` (in prefix order) worth loading: the one whose recompute
    time saved, minus its expected arrival, is largest and positive; nothing if none is.

    Arrival counts each tier's round trip once per read window of `PREFETCH_WINDOW` chunks and
    its bytes behind the bytes already queued on that tier."""
    best = Decision(0, 0, 0.0, 0.0)
    speed = prefill.tokens_per_s(prompt_len)
    elapsed = 0.0  # arrival of everything in the spans before this one
    tokens = chunks = 0
    guessed = False
    for span in spans:
        latency, bandwidth = span.tier.latency_s, span.tier.read_bytes_per_s
        guessed = guessed or not span.tier.known_for(span.chunks * span.chunk_bytes)
        start = elapsed + span.tier.eta_s(0) - latency  # behind what is queued on the tier
        for k in range(1, span.chunks + 1):
            arrival = start + math.ceil(k / PREFETCH_WINDOW) * latency \
                + k * span.chunk_bytes / bandwidth
            saved = (tokens + k * span.chunk_tokens) / speed
            if saved > arrival and saved - arrival >= best.saved_s - best.expected_s:
                best = Decision(chunks + k, tokens + k * span.chunk_tokens, arrival, saved,
                                guessed)
            elapsed = arrival
        tokens += span.chunks * span.chunk_tokens
        chunks += span.chunks
    return best
