"""Where a prompt's segments are, and the keys they are cached under.

A segment is a run of tokens the caller marked as reusable on its own: every run that a
separator (a configured string, tokenized once) ends. What follows the last separator (the
question) is not a segment. Separator tokens belong to no segment: they are always computed.

A segment's key is the chain of its own tokens from the segment root (`KeyBuilder.root(salt,
segment=True)`): position and order play no part, the model identity, layout, rank and a
request's salt do, and no segment key is ever a prefix key.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtier.engine.segments import Segment, segment_chain

# Segment and segment_chain live with the segment store in the engine wing (re-exported here).
__all__ = ["Segment", "find_segments", "segment_chain"]


def _occurrences(tokens: Sequence[int] | np.ndarray, pattern: Sequence[int]) -> list[int]:
    """Start indices of non-overlapping occurrences of `pattern` in `tokens`, left to right
    (candidates found by numpy: this runs at every match of a long prompt)."""
    ids = np.asarray(tokens, dtype=np.int64)
    want = np.asarray(pattern, dtype=np.int64)
    m = len(want)
    if len(ids) < m:
        return []
    out: list[int] = []
    after = 0
    for i in np.flatnonzero(ids[:len(ids) - m + 1] == want[0]).tolist():
        if i >= after and (m == 1 or np.array_equal(ids[i:i + m], want)):
            out.append(i)
            after = i + m
    return out


def find_segments(tokens: Sequence[int] | torch.Tensor | np.ndarray, separator: Sequence[int],
                  min_tokens: int = 1) -> list[Segment]:
    """The segments of `tokens`: each run that ends at an occurrence of `separator` and holds at
    least `min_tokens` tokens (shorter runs are computed, not cached), in prompt order.

    Raises:
        ValueError: `separator` is empty, or `min_tokens` < 1.
    """
    if not len(separator):
        raise ValueError("separator must hold at least one token id")
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    ids = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else tokens
    out: list[Segment] = []
    start = 0
    for at in _occurrences(ids, list(separator)):
        if at - start >= min_tokens:
            out.append(Segment(start, at))
        start = at + len(separator)
    return out
