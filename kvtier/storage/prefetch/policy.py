"""Prefetch policies: how long a request waits for its load, and how much of its hit loads.

- `adaptive` (the default): the load is planned from measured tier and prefill speeds
  (`planner.py`); the request waits until what arrives sooner than it recomputes
  is in, or that part's deadline. Until the plan exists, the deadline is what a load could
  save at the measured speeds (none while a lower tier is unmeasured: admitted at once).
- `best_effort`: never waits; the load goes on in the background.
- `timeout`: waits until the load is done or `prefetch_timeout_base_ms` +
  `prefetch_timeout_per_token_ms` x tokens passed.
- `wait_complete`: waits until the load is done, at most `prefetch_wait_complete_max_ms` (a
  ceiling: reaching it logs a warning).
"""

from __future__ import annotations

import logging

from kvtier.config.names import ADAPTIVE, BEST_EFFORT, PREFETCH_POLICIES, TIMEOUT, WAIT_COMPLETE
from kvtier.config.schema import PrefetchSection
from kvtier.keys import ChunkKey
from kvtier.metrics import RateLimitedLog
from kvtier.storage.guard import GuardedTier
from kvtier.storage.prefetch.handle import Prefetch, Waiting
from kvtier.storage.prefetch.planner import Admission, LoadPlanner

__all__ = ["PrefetchPolicy", "Adaptive", "BestEffort", "Timeout", "WaitComplete", "POLICIES",
           "prefetch_policy"]

logger = logging.getLogger(__name__)
_warn = RateLimitedLog(logger)


class PrefetchPolicy(Waiting):
    """One prefetch policy: one shared, stateless instance, asked at each point of a load.

    The default waits for the whole hit (every chunk some tier holds, up to the CPU tier's
    promotion cap) until its deadline; a subclass overrides what it decides differently."""

    name = "?"

    def budget_s(self, section: PrefetchSection, tokens: int, recompute_s: float) -> float:
        """How long after the start the caller stops waiting (for a prefetch of `tokens`
        tokens that take `recompute_s` to recompute), unless the plan moves it."""
        return 0.0

    def start(self, planner: LoadPlanner, prefetch: Prefetch, admission: Admission) -> None:
        """`prefetch` is about to be queued (`admission`: what the planner said before any
        round trip). Runs on the serving thread: must not block."""

    def plan(self, planner: LoadPlanner, prefetch: Prefetch, hot_chunks: int) -> int:
        """How many leading chunks of `prefetch.keys` the load brings into the CPU tier (the
        first `hot_chunks` are there). Runs on a prefetch worker: may make round trips."""
        return min(len(prefetch.keys), planner.cap(prefetch.keys, hot_chunks))

    def tail_worth(self, planner: LoadPlanner, prefetch: Prefetch, n: int, tier: GuardedTier,
                   tail: ChunkKey) -> bool:
        """Whether to read `tail` (stored after `prefetch`'s first `n` chunks, held by lower
        `tier`) once the chunks are in. Runs on a prefetch worker."""
        return True

    def went_on(self, prefetch: Prefetch, waited_s: float) -> bool:
        return True


class Adaptive(PrefetchPolicy):
    """Load what arrives sooner than it recomputes, from measured speeds (`LoadPlanner`)."""

    name = ADAPTIVE

    def budget_s(self, section: PrefetchSection, tokens: int, recompute_s: float) -> float:
        return recompute_s  # the planner's budget before its plan (`budget_before_plan_s`)

    def start(self, planner: LoadPlanner, prefetch: Prefetch, admission: Admission) -> None:
        # Admitted before its plan while a tier that might pay is unmeasured: its load must
        # still run, for later requests and to time the tier (the plan narrows this down).
        prefetch.background = admission.guessing
        prefetch.after(lambda _: planner.unplanned(prefetch))

    def plan(self, planner: LoadPlanner, prefetch: Prefetch, hot_chunks: int) -> int:
        return planner.plan(prefetch, hot_chunks)

    def tail_worth(self, planner: LoadPlanner, prefetch: Prefetch, n: int, tier: GuardedTier,
                   tail: ChunkKey) -> bool:
        return planner.tail_worth(prefetch, n, tier, tail)


class BestEffort(PrefetchPolicy):
    """Never wait: the load goes on in the background."""

    name = BEST_EFFORT

    def admit(self, prefetch: Prefetch, now: float) -> bool:
        return True

    def went_on(self, prefetch: Prefetch, waited_s: float) -> bool:
        return False  # it never waited: nothing timed out


class Timeout(PrefetchPolicy):
    """Wait for the load, up to a deadline that grows with the prompt."""

    name = TIMEOUT

    def budget_s(self, section: PrefetchSection, tokens: int, recompute_s: float) -> float:
        return (section.timeout_base_ms + section.timeout_per_token_ms * tokens) / 1e3


class WaitComplete(PrefetchPolicy):
    """Wait for the whole load; the ceiling is a safety net, and reaching it a warning."""

    name = WAIT_COMPLETE

    def budget_s(self, section: PrefetchSection, tokens: int, recompute_s: float) -> float:
        return section.wait_complete_max_ms / 1e3

    def went_on(self, prefetch: Prefetch, waited_s: float) -> bool:
        _warn.warning("wait-ceiling", "kvtier: a wait_complete prefetch of %d chunks still ran "
                      "after %.1f s (prefetch_wait_complete_max_ms); the request goes on with "
                      "what arrived", len(prefetch.keys), waited_s)
        return False


POLICIES: dict[str, PrefetchPolicy] = {
    cls.name: cls() for cls in (Adaptive, BestEffort, Timeout, WaitComplete)}
# The config offers exactly the names in kvtier.config.names: a policy added there is built here. A
# raise, not an assert, so that `python -O` still refuses a table that lacks one.
if set(POLICIES) != set(PREFETCH_POLICIES):
    raise RuntimeError(f"kvtier.storage.prefetch.policy has {sorted(POLICIES)}, but "
                       f"kvtier.config.names lists {sorted(PREFETCH_POLICIES)}")


def prefetch_policy(name: str) -> PrefetchPolicy:
    """The policy called `name`; `ValueError` naming the choices if there is none."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {PREFETCH_POLICIES}, got {name!r}") from None
