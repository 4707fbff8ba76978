"""Load or recompute: how much of a request's cached prefix a prefetch should load.

`decide` (kvtier.storage.prefetch.decision) is the whole policy, a pure function of the
estimates: given where each hit chunk lives and how fast each tier and the engine are now, it
picks the leading span whose loading saves the most time over recomputing it (none if loading
loses everywhere). `LoadPlanner`
applies it to a live prefetch: it asks the lower tiers where the chunks are (one round trip
each, or none where the tier's recent answers cover them, skipping a tier whose round trip
alone costs more than recomputing the whole prompt), decides, caps one request's promotion to
a share of the CPU tier, sets the prefetch's deadline, and counts what was loaded and what was
recomputed, and why.

Guesses never cost a wait. A probe times every tier when it is built (a scratch record
written, read and deleted, before the server serves: `TierSet`), so a restarted server or a
new instance plans its very first request on measured speeds. Until a tier's round trip and
read bandwidth are both measured (its probe failed or ran out of time), a request waits for
no load that involves it, except one so small that its round trips are its time
(`TierSpeed.known_for`): it is admitted at once, and the load goes on in the background,
promoting the chunks for later requests and timing the tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvtier.keys import ChunkKey
from kvtier.metrics import Counters, RateLimitedLog
from kvtier.storage.guard import GuardedTier
from kvtier.storage.prefetch.decision import (
    DEADLINE_FLOOR_S,
    DEADLINE_SLACK,
    Decision,
    Span,
    decide,
)
from kvtier.storage.prefetch.estimates import PrefillSpeed, TierSpeed
from kvtier.storage.prefetch.handle import Prefetch

__all__ = ["Span", "Decision", "decide", "Admission", "LoadPlanner", "REASONS",
           "DEADLINE_SLACK", "DEADLINE_FLOOR_S", "probe_reads"]

logger = logging.getLogger(__name__)

# Why prompt tokens past a load were recomputed (`unmeasured`: the load ran in the background,
# since a tier of it had no measured speed yet).
REASONS = ("slower_than_recompute", "deadline", "miss", "promotion_cap", "unmeasured")
PROBE_CHUNKS = 1  # a probe reads one chunk: a bandwidth sample, and little load on a slow tier
# One request's load never promotes more than this share of the CPU tier: a prompt larger
# than the CPU tier must not evict every other tenant's chunks on its way through.
MAX_PROMOTE_FRACTION = 0.5


class Admission(NamedTuple):
    """What a prompt's request may wait for before its plan. `budget_s`: how long (0: admitted
    at once). `reason`: why its tokens count as recomputed if it is admitted before its plan
    (one of `REASONS`: `deadline` when it waited its budget). `guessing`: some tier that might
    pay has no measured speed yet, so a load from it goes on in the background."""

    budget_s: float
    reason: str
    guessing: bool


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
        self._warn = RateLimitedLog(logger, interval=60.0)
        counters.declare("adaptive_tokens_loaded",
                          *(f"adaptive_tokens_recomputed_{r}" for r in REASONS))

    def unmeasured(self) -> bool:
        """Whether some lower tier has no measured speed yet (`TierSpeed.known`)."""
        return not all(tier.speed.known for tier in self._tiers())

    def admission(self, tokens: int, keys: Sequence[ChunkKey] = ()) -> Admission:
        """How long a prompt of `tokens` tokens (chunks `keys`, when known) may wait for its
        plan under `adaptive`: what a load of all of it could save at the speeds measured now,
        over the best tier that is worth waiting for.

        A tier's best case is its lookup's round trip (none when its recent answers cover
        `keys`), then the read's round trip and the transfer. A tier whose round trips alone
        are longer than the recompute cannot pay and is left out. So is one whose lookups hit
        too rarely: a request that waits for a lookup that misses pays its round trip for
        nothing, so a tier is waited for only while its hit rate times the best case's saving
        exceeds its miss rate times the lookup's round trip. A tier remembered to lack the
        first chunk adds nothing. A tier not measured yet adds nothing either (asking it may
        take longer than any load could save): its hits load in the background."""
        full = self.prefill.recompute_s(tokens, tokens)
        nbytes = self._chunk_bytes(tokens)
        budget, guessing = 0.0, False
        for tier in self._tiers():
            speed = tier.speed
            lookup_s = self._lookup_s(tier, keys)
            if lookup_s is None:
                continue  # its recent answer: it holds none of the prompt
            trips = lookup_s + speed.latency_s
            if speed.latency_measured and trips >= full:
                continue  # hopeless for this prompt, whatever its bandwidth
            if not speed.known_for(nbytes):
                guessing = True
                continue
            saved = full - trips - nbytes / speed.read_bytes_per_s
            hit = speed.hit_rate
            if hit * saved > (1 - hit) * lookup_s:
                budget = max(budget, saved)
        budget = min(full, budget)
        reason = "deadline" if budget > 0 else \
            "unmeasured" if guessing else "slower_than_recompute"
        return Admission(budget, reason, guessing)

    @staticmethod
    def _lookup_s(tier: GuardedTier, keys: Sequence[ChunkKey]) -> float | None:
        """What asking `tier` where `keys` are costs: 0 when its recent answers cover them
        (`Existence`), None when they say it lacks the first one, else a round trip."""
        if keys:
            held, answered = tier.existence.leading(keys[:1])
            if answered:
                return 0.0 if held else None
        return tier.speed.latency_s

    def budget_before_plan_s(self, tokens: int) -> float:
        """`admission(tokens).budget_s`."""
        return self.admission(tokens).budget_s

    def cap(self, keys: Sequence[ChunkKey], hot_chunks: int) -> int:
        """How many leading chunks of `keys` one load may leave in the CPU tier (the first
        `hot_chunks` are there): a share of the tier, so that one long prompt cannot evict
        every other tenant's chunks on its way through."""
        return hot_chunks + self._cap_bytes // max(1, self._chunk_bytes(keys[0].num_tokens))

    def plan(self, prefetch: Prefetch, hot_chunks: int) -> int:
        """How many leading chunks of `prefetch.keys` the load should bring into the CPU tier
        (the first `hot_chunks` are there). The `adaptive` plan: sets the deadline; makes round
        trips to the lower tiers, so it runs on a prefetch worker.

        The request waits only for the part of the load on tiers with measured speeds (the
        spans before the first unmeasured tier); the rest of the hits load in the background
        (`Prefetch.background`), for later requests."""
        keys = prefetch.keys
        cap = self.cap(keys, hot_chunks)
        # Admitted before this plan (a budget of 0, or its budget ran out first): it waited for
        # none of this load, which goes on for later requests; what the CPU tier holds now may
        # be the request's own stores, so its accounting cannot be read off this plan.
        early = prefetch.used
        prompt = sum(k.num_tokens for k in keys)
        spans, skipped = self._locate(keys, hot_chunks, prompt)
        hits = hot_chunks + sum(s.chunks for s in spans)
        prefetch.hits = hits
        known = 0
        while known < len(spans) and spans[known].tier.known_for(
                spans[known].chunks * spans[known].chunk_bytes):
            known += 1
        decision = decide(spans[:known], self.prefill, prompt)
        waited = min(hot_chunks + decision.chunks, cap)
        limit = min(hits, cap) if known < len(spans) else waited
        if early is not None:
            self._count_early(prefetch, early)
            waited = hot_chunks
        prefetch.background = limit > waited
        if known < len(spans):
            self._say_unmeasured(spans[known:], sum(k.num_tokens for k in keys[waited:limit]))
        planned = self._queue(spans, limit - hot_chunks)
        now = time.monotonic()
        prefetch.set_deadline(now + decision.deadline_s if waited > hot_chunks else now)
        prefetch.after(lambda loaded: self._settle(prefetch, planned, hot_chunks, waited, limit,
                                                   hits, not skipped, loaded,
                                                   counted=early is not None))
        logger.debug("kvtier: adaptive plan for %d chunks: %d in CPU, %d more in %s; waiting "
                     "for %d (expected %.1f ms, saves %.1f ms of recompute at %.0f tokens/s), "
                     "%d more in the background (tiers not measured yet)%s",
                     len(keys), hot_chunks, hits - hot_chunks,
                     [(s.tier.name, s.chunks) for s in spans], waited - hot_chunks,
                     decision.expected_s * 1e3, decision.saved_s * 1e3,
                     self.prefill.tokens_per_s(prompt), limit - waited,
                     f"; not asked (slower than recompute): {[t.name for t in skipped]}"
                     if skipped else "")
        for tier in skipped:  # on the tier's probe thread: no prefetch worker waits for it
            if tier.speed.probe_due(now):
                probe_reads(tier, keys[hits:])
        return limit

    def _say_unmeasured(self, spans: Sequence[Span], tokens: int) -> None:
        """Why a hit is recomputed although a tier holds it (issue: a new instance on a
        shared Redis recomputed its first request and nothing said why)."""
        names = sorted({s.tier.name for s in spans})
        self._warn.warning(
            f"unmeasured-{names}", "kvtier: %d prompt tokens held by %s are recomputed: %s "
            "read speed is not measured yet (the start-up probe did not finish or the tier "
            "was down); they load in the background, so the next request hits",
            tokens, "/".join(names), "its" if len(names) == 1 else "their")

    def unplanned(self, prefetch: Prefetch) -> None:
        """Account for a prefetch that ended before its plan (its request admitted first,
        with no background load to run: see `admission`): its tokens count as recomputed for
        the reason it was not waited for."""
        if prefetch.limit is None and prefetch.keys:
            self._counters.inc(f"adaptive_tokens_recomputed_{prefetch.unwaited}",
                               sum(k.num_tokens for k in prefetch.keys))

    def tail_worth(self, prefetch: Prefetch, n: int, tier: GuardedTier, tail: ChunkKey,
                   ) -> bool:
        """Whether to read `tail` (after `prefetch`'s first `n` chunks, held by lower `tier`):
        only after every hit chunk was loaded and if it arrives sooner than its tokens
        recompute; then the deadline moves to include it."""
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
                got = tier.recall_contains(keys[n:])
                tier.speed.observe_lookup(got > 0)
                if got:
                    spans.append(best._replace(chunks=got))
                    n += got
                    break
            else:
                break
        return spans, skipped

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

    def _count_early(self, prefetch: Prefetch, used: int) -> None:
        """Account for a request admitted before its plan with `used` leading chunks: the
        rest was recomputed for the reason it was not waited for (`Prefetch.unwaited`)."""
        keys = prefetch.keys
        self._counters.inc("adaptive_tokens_loaded", sum(k.num_tokens for k in keys[:used]))
        self._counters.inc(f"adaptive_tokens_recomputed_{prefetch.unwaited}",
                           sum(k.num_tokens for k in keys[used:]))

    def _settle(self, prefetch: Prefetch, planned: list[tuple[TierSpeed, int]], hot: int,
                waited: int, limit: int, hits: int, asked_all: bool, loaded: int, *,
                counted: bool) -> None:
        for tier, nbytes in planned:
            tier.unqueue(nbytes)
        if counted:  # admitted before its plan: `_count_early` did
            return
        keys = prefetch.keys

        def tokens(a: int, b: int) -> int:
            return sum(k.num_tokens for k in keys[a:b])

        # What the request got: a chunk that arrived after it was admitted was not its.
        got = min(loaded, limit, loaded if prefetch.used is None else prefetch.used)
        count = self._counters.inc
        count("adaptive_tokens_loaded", tokens(0, got))
        count("adaptive_tokens_recomputed_deadline", tokens(got, waited))
        count("adaptive_tokens_recomputed_unmeasured", tokens(max(got, waited), limit))
        capped = hot + self._cap_bytes // max(1, self._chunk_bytes(keys[0].num_tokens))
        chosen = min(hits, capped)
        count("adaptive_tokens_recomputed_slower_than_recompute", tokens(limit, chosen))
        count("adaptive_tokens_recomputed_promotion_cap", tokens(chosen, hits))
        rest = tokens(hits, len(keys))
        count("adaptive_tokens_recomputed_miss" if asked_all
              else "adaptive_tokens_recomputed_slower_than_recompute", rest)


def probe_reads(tier: GuardedTier, keys: Sequence[ChunkKey]) -> None:
    """Refresh the estimates of a tier no request asks any more, on a thread of its own (no
    prefetch worker waits for a slow tier): a round trip, and a read of what it holds of
    `keys` (at most `PROBE_CHUNKS`)."""
    def probe() -> None:
        got = tier.batch_contains(keys)
        for obj in tier.batch_get(keys[:min(got, PROBE_CHUNKS)]) if got else []:
            obj.release()

    threading.Thread(target=probe, name=f"kvtier-probe-{tier.name}", daemon=True).start()
