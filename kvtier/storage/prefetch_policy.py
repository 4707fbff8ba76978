"""Prefetch policies: how long a request waits for its load before it runs without the rest.

- `adaptive` (the default): the load is planned from measured tier and prefill speeds
  (`kvtier.storage.planner`); the request waits until what arrives sooner than it recomputes
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
from kvtier.metrics import RateLimitedLog

__all__ = ["PrefetchPolicy", "Adaptive", "BestEffort", "Timeout", "WaitComplete", "POLICIES",
           "prefetch_policy"]

logger = logging.getLogger(__name__)
_warn = RateLimitedLog(logger)


class PrefetchPolicy:
    """What a prefetch's caller waits for (one shared, stateless instance per policy)."""

    name = "?"
    waits = True  # whether the caller waits at all
    planned = False  # whether the load is planned from measured speeds (else: every hit)
    # Whether a wait that ends at the deadline with the load unfinished counts as a timeout.
    counts_timeouts = False

    def budget_s(self, section: PrefetchSection, tokens: int, recompute_s: float) -> float:
        """How long after the start the caller stops waiting (for a prefetch of `tokens`
        tokens that take `recompute_s` to recompute), unless the plan moves it."""
        return 0.0

    def at_deadline(self, chunks: int, waited_s: float) -> None:
        """The caller stopped waiting at the deadline with the load unfinished."""


class Adaptive(PrefetchPolicy):
    name = ADAPTIVE
    planned = True
    counts_timeouts = True

    def budget_s(self, section: PrefetchSection, tokens: int, recompute_s: float) -> float:
        return recompute_s  # the planner's budget before its plan (`budget_before_plan_s`)


class BestEffort(PrefetchPolicy):
    name = BEST_EFFORT
    waits = False


class Timeout(PrefetchPolicy):
    name = TIMEOUT
    counts_timeouts = True

    def budget_s(self, section: PrefetchSection, tokens: int, recompute_s: float) -> float:
        return (section.timeout_base_ms + section.timeout_per_token_ms * tokens) / 1e3


class WaitComplete(PrefetchPolicy):
    name = WAIT_COMPLETE

    def budget_s(self, section: PrefetchSection, tokens: int, recompute_s: float) -> float:
        return section.wait_complete_max_ms / 1e3

    def at_deadline(self, chunks: int, waited_s: float) -> None:
        _warn.warning("wait-ceiling", "kvtier: a wait_complete prefetch of %d chunks still ran "
                      "after %.1f s (prefetch_wait_complete_max_ms); the request goes on with "
                      "what arrived", chunks, waited_s)


POLICIES: dict[str, PrefetchPolicy] = {
    cls.name: cls() for cls in (Adaptive, BestEffort, Timeout, WaitComplete)}
# The config offers exactly the names in kvtier.config.names: a policy added there is built here. A
# raise, not an assert, so that `python -O` still refuses a table that lacks one.
if set(POLICIES) != set(PREFETCH_POLICIES):
    raise RuntimeError(f"kvtier.storage.prefetch_policy has {sorted(POLICIES)}, but "
                       f"kvtier.config.names lists {sorted(PREFETCH_POLICIES)}")


def prefetch_policy(name: str) -> PrefetchPolicy:
    """The policy called `name`; `ValueError` naming the choices if there is none."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {PREFETCH_POLICIES}, got {name!r}") from None
