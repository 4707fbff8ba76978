"""Load or recompute: how much of a request's cached prefix a prefetch should load.

`decide` is the whole policy, a pure function of the estimates: given where each hit chunk
lives and how fast each tier and the engine are now, it picks the leading span whose loading
saves the most time over recomputing it (none if loading loses everywhere). `LoadPlanner`
applies it to a live prefetch: it asks the lower tiers where the chunks are (one round trip
each, skipping a tier whose round trip alone costs more than recomputing the whole prompt),
decides, caps one request's promotion to a share of the CPU tier, sets the prefetch's
deadline, and counts what was loaded and what was recomputed, and why.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvtier.keys import ChunkKey
from kvtier.metrics import Counters
from kvtier.storage.estimates import PrefillSpeed, TierSpeed
from kvtier.storage.guard import GuardedTier
from kvtier.storage.prefetch import PREFETCH_WINDOW, Prefetch

__all__ = ["Span", "Decision", "decide", "LoadPlanner", "REASONS", "DEADLINE_SLACK", "GUESS_FLOOR"]

logger = logging.getLogger(__name__)

# Why prompt tokens past a load were recomputed.
REASONS = ("slower_than_recompute", "deadline", "miss", "promotion_cap")
# A load may run this much past its expected arrival before the request goes on without the
# rest, and at least until half its saving is spent (a busy host's scheduling noise must not
# cut off a load that saves far more than it costs); never past the point where recomputing
# would have been done: see `Decision`.
DEADLINE_SLACK = 1.5
DEADLINE_GRACE_S = 0.005
# A plan on a tier whose reads were never timed runs on the bandwidth prior, a guess: it may
# wait only this share of its saving (not half), so a first request on a slow tier pays a
# small bet, not half its recompute, before the tier's first read measures it.
GUESS_FLOOR = 0.125
# One request's load never promotes more than this share of the CPU tier: a prompt larger
# than the CPU tier must not evict every other tenant's chunks on its way through.
MAX_PROMOTE_FRACTION = 0.5
PROBE_CHUNKS = 1  # a probe reads one chunk: a bandwidth sample, and little load on a slow tier


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
    the recompute, and only when the tier broke its own estimate). `guessed`: some tier of
    the load has no timed read yet, so `expected_s` rests on the bandwidth prior and the
    floor is `GUESS_FLOOR` of `saved_s` instead of half."""

    chunks: int
    tokens: int
    expected_s: float
    saved_s: float
    guessed: bool = False

    @property
    def deadline_s(self) -> float:
        slack = self.expected_s * DEADLINE_SLACK + DEADLINE_GRACE_S
        floor = self.saved_s * (GUESS_FLOOR if self.guessed else 0.5)
        return min(self.saved_s, max(slack, floor))


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
        guessed = guessed or not span.tier.measured
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


class LoadPlanner:
    """Plans each prefetch's load under the `adaptive` policy (the other policies load every
    hit, within the promotion cap).

    Args:
        tiers: the attached lower tiers now, fastest first (each with its `speed`).
        prefill: the engine's prefill speed.
        chunk_bytes: bytes of a chunk of `n` tokens.
        arena_bytes: the CPU tier's size (for the promotion cap).
        counters: counts tokens loaded and recomputed by reason (`adaptive_tokens_*`).
    """

    def __init__(self, tiers: Callable[[], Sequence[GuardedTier]],
                 prefill: PrefillSpeed, chunk_bytes: Callable[[int], int], arena_bytes: int,
                 counters: Counters):
        self._tiers = tiers
        self.prefill = prefill
        self._chunk_bytes = chunk_bytes
        self._cap_bytes = int(arena_bytes * MAX_PROMOTE_FRACTION)
        self._counters = counters
        counters.declare("adaptive_tokens_loaded",
                          *(f"adaptive_tokens_recomputed_{r}" for r in REASONS))

    def budget_before_plan_s(self, tokens: int) -> float:
        """How long a prompt of `tokens` tokens may wait for its plan under `adaptive`: its
        recompute time (no load can win after it), or `GUESS_FLOOR` of it while a lower
        tier's round trip was never timed (the plan's first question to such a tier may take
        longer than any load from it could save)."""
        full = self.prefill.recompute_s(tokens, tokens)
        if all(tier.speed.latency_measured for tier in self._tiers()):
            return full
        return full * GUESS_FLOOR

    def plan(self, prefetch: Prefetch, hot_chunks: int) -> int:
        """How many leading chunks of `prefetch.keys` the load should bring into the CPU tier
        (the first `hot_chunks` are there). Sets the deadline under `adaptive`; makes round
        trips to the lower tiers, so it runs on a prefetch worker."""
        keys = prefetch.keys
        cap = hot_chunks + self._cap_bytes // max(1, self._chunk_bytes(keys[0].num_tokens))
        if not prefetch.policy.planned:
            return min(len(keys), cap)
        prompt = sum(k.num_tokens for k in keys)
        spans, skipped = self._locate(keys, hot_chunks, prompt)
        hits = hot_chunks + sum(s.chunks for s in spans)
        prefetch.hits = hits
        decision = decide(spans, self.prefill, prompt)
        limit = min(hot_chunks + decision.chunks, cap)
        planned = self._queue(spans, limit - hot_chunks)
        now = time.monotonic()
        prefetch.set_deadline(now + decision.deadline_s if limit > hot_chunks else now)
        if decision.guessed and limit > hot_chunks:
            prefetch.recheck_at_deadline(
                lambda: self._remeasured(now, spans, limit - hot_chunks, prompt))
        prefetch.after(lambda loaded: self._settle(prefetch, planned, hot_chunks, limit, hits,
                                                   not skipped, loaded))
        logger.debug("kvtier: adaptive plan for %d chunks: %d in CPU, %d more in %s; loading "
                     "%d (expected %.1f ms, saves %.1f ms of recompute at %.0f tokens/s)%s",
                     len(keys), hot_chunks, hits - hot_chunks,
                     [(s.tier.name, s.chunks) for s in spans], limit - hot_chunks,
                     decision.expected_s * 1e3, decision.saved_s * 1e3,
                     self.prefill.tokens_per_s(prompt),
                     f"; not asked (slower than recompute): {[t.name for t in skipped]}"
                     if skipped else "")
        for tier in skipped:  # the request has its deadline: a round trip now delays nobody
            if tier.speed.probe_due(now):
                self._probe(tier, keys[hits:])
        return limit

    def _remeasured(self, start: float, spans: Sequence[Span], chunks: int, prompt: int,
                    ) -> float | None:
        """At the deadline of a plan made on the bandwidth prior: the deadline the plan gets
        on the speeds its first chunks have measured since (None while a tier of it is still
        unmeasured, or if the load now loses to recompute)."""
        tokens, expected = 0, 0.0
        for span in spans:
            take = min(chunks, span.chunks)
            if take <= 0:
                break
            if not span.tier.measured:
                return None
            expected += math.ceil(take / PREFETCH_WINDOW) * span.tier.latency_s \
                + take * span.chunk_bytes / span.tier.read_bytes_per_s
            tokens += take * span.chunk_tokens
            chunks -= take
        saved = self.prefill.recompute_s(tokens, prompt)
        if expected >= saved:
            return None
        return start + Decision(0, tokens, expected, saved).deadline_s

    def tail_worth(self, prefetch: Prefetch, n: int, tier: GuardedTier, tail: ChunkKey,
                   ) -> bool:
        """Whether to read `tail` (after `prefetch`'s first `n` chunks, held by lower `tier`):
        always under the other policies; under `adaptive` only after every hit chunk was
        loaded and if it arrives sooner than its tokens recompute, and then the deadline
        moves to include it."""
        if not prefetch.policy.planned:
            return True
        if prefetch.hits is not None and n < prefetch.hits:
            return False  # the plan stopped short of the chunks before the tail
        span = Span(tier.speed, 1, self._chunk_bytes(tail.num_tokens), tail.num_tokens)
        decision = decide([span], self.prefill, tail.end)
        if not decision.chunks:
            return False
        prefetch.set_deadline(max(prefetch.deadline, time.monotonic() + decision.deadline_s))
        return True

    def _locate(self, keys: Sequence[ChunkKey], n: int, prompt: int,
                ) -> tuple[list[Span], list[GuardedTier]]:
        """The spans of lower-tier hits after the first `n` keys, in prefix order; and the
        tiers not asked because even holding every chunk left, they would save nothing (a
        round trip alone costs more than recomputing the rest, or the bytes arrive too late)."""
        spans: list[Span] = []
        skipped: list[GuardedTier] = []
        tiers = list(self._tiers())
        while n < len(keys) and tiers:
            size = keys[n].num_tokens
            for tier in tiers:
                best = Span(tier.speed, len(keys) - n, self._chunk_bytes(size), size)
                found = sum(s.chunks for s in spans)
                if decide([*spans, best], self.prefill, prompt).chunks <= found:
                    if tier not in skipped:
                        skipped.append(tier)
                    continue
                got = tier.batch_contains(keys[n:])
                if got:
                    spans.append(best._replace(chunks=got))
                    n += got
                    break
            else:
                break
        return spans, skipped

    def _probe(self, tier: GuardedTier, keys: Sequence[ChunkKey]) -> None:
        """Refresh the estimates of a tier no request asks any more: a round trip, and a read
        of what it holds of `keys` (at most `PROBE_CHUNKS`), for no request (worker thread)."""
        got = tier.batch_contains(keys)
        for obj in tier.batch_get(keys[:min(got, PROBE_CHUNKS)]) if got else []:
            obj.release()

    def _queue(self, spans: Sequence[Span], chunks: int) -> list[tuple[TierSpeed, int]]:
        planned = []
        for span in spans:
            take = min(chunks, span.chunks)
            if take <= 0:
                break
            planned.append((span.tier, take * span.chunk_bytes))
            span.tier.queue(take * span.chunk_bytes)
            chunks -= take
        return planned

    def _settle(self, prefetch: Prefetch, planned: list[tuple[TierSpeed, int]], hot: int,
                limit: int, hits: int, asked_all: bool, loaded: int) -> None:
        for tier, nbytes in planned:
            tier.unqueue(nbytes)
        keys = prefetch.keys

        def tokens(a: int, b: int) -> int:
            return sum(k.num_tokens for k in keys[a:b])

        # What the request got: a chunk that arrived after it was admitted was not its.
        loaded = min(loaded, limit, loaded if prefetch.used is None else prefetch.used)
        count = self._counters.inc
        count("adaptive_tokens_loaded", tokens(0, loaded))
        count("adaptive_tokens_recomputed_deadline", tokens(loaded, limit))
        capped = hot + self._cap_bytes // max(1, self._chunk_bytes(keys[0].num_tokens))
        chosen = min(hits, capped)
        count("adaptive_tokens_recomputed_slower_than_recompute", tokens(limit, chosen))
        count("adaptive_tokens_recomputed_promotion_cap", tokens(chosen, hits))
        rest = tokens(hits, len(keys))
        count("adaptive_tokens_recomputed_miss" if asked_all
              else "adaptive_tokens_recomputed_slower_than_recompute", rest)
