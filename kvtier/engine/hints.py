"""Lifecycle hints: what a request knows about its own prefix's future, given to `store`.

- `retain_s`: keep the prefix in the CPU tier for at least this many seconds after the store:
  an agent's prefix across a tool call, a system prompt between bursts. Eviction policies
  guess from the past; the caller knows. The prefix is pinned as a session's turn is
  (`kvtier.storage.sessions`, within the same per-pin quota and the shared cap), under a
  name derived from its last chunk's key, so every request retaining the same prefix renews
  one pin, and a store with a new `retain_s` restarts its clock.
- `ephemeral_from`: the tokens from this position on are never stored (thinking tokens, a
  one-off question after a shared document, a tool's bulky output): the chunks before it are
  stored as usual. A prefix never has a hole, so an ephemeral span ends the stored prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvtier.keys import ChunkKey, TokenIds

__all__ = ["Hints", "MAX_RETAIN_S", "cut", "retain_name"]

MAX_RETAIN_S = 86_400.0  # a day: a longer pin is a capacity plan, not a hint


class Hints(NamedTuple):
    """A store's lifecycle hints (see the module docstring); `Hints()` changes nothing."""

    retain_s: float | None = None
    ephemeral_from: int | None = None

    def check(self) -> Hints:
        """`self`, or `ValueError` naming the bad field."""
        if self.retain_s is not None and (
                isinstance(self.retain_s, bool) or not isinstance(self.retain_s, int | float)
                or not 0 < self.retain_s <= MAX_RETAIN_S):
            raise ValueError(f"retain_s must be a number of seconds in (0, {MAX_RETAIN_S:g}], "
                             f"got {self.retain_s!r}")
        if self.ephemeral_from is not None and (
                isinstance(self.ephemeral_from, bool) or not isinstance(self.ephemeral_from, int)
                or self.ephemeral_from < 0):
            raise ValueError(f"ephemeral_from must be a token position >= 0, "
                             f"got {self.ephemeral_from!r}")
        return self


def retain_name(keys: Sequence[ChunkKey]) -> str:
    """The pin name of the prefix ending with `keys[-1]` (its key names the whole chain)."""
    return "retain/" + keys[-1].key


def cut(hints: Hints | None, token_ids: TokenIds, slot_mapping: torch.Tensor,
        also_prefix: int | None) -> tuple[TokenIds, torch.Tensor, int | None]:
    """`store`'s arguments less what `hints` says is never stored (after checking them)."""
    end = None if hints is None else hints.check().ephemeral_from
    if end is None:
        return token_ids, slot_mapping, also_prefix
    return (token_ids[:end], slot_mapping[:end],
            None if also_prefix is None or also_prefix > end else also_prefix)
