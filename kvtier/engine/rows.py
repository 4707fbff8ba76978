"""Which rows of the serving engine's pool a load writes: the caller's `limit` on the tokens
asked for, and the rows before `skip` (the pool holds them) or past the limit left alone."""

from __future__ import annotations

import torch

__all__ = ["limit_of", "pool_rows"]


def limit_of(limit: int | None, num_tokens: int) -> int:
    """`limit` checked, and at most `num_tokens` (all of them when None)."""
    if limit is None:
        return num_tokens
    if not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be a non-negative int, got {limit!r}")
    return min(limit, num_tokens)


def pool_rows(slots: torch.Tensor, start: int, end: int, skip: int, limit: int) -> torch.Tensor:
    """Pool rows of tokens [start, end), with -1 (not written) before `skip` (the pool holds
    them) and from `limit` on (not asked for)."""
    rows = slots if start == 0 and end == slots.numel() else slots[start:end]
    if start < skip or end > limit:
        rows = rows.clone()
        rows[: max(0, skip - start)] = -1
        rows[max(0, limit - start):] = -1
    return rows
