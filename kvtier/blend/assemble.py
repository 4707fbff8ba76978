"""A prompt's known KV, put together from its cached segments: what `forward.blend` starts from.

Each segment's stored KV (computed at positions 0..n-1) is read into the rows where the segment
now stands and its keys are re-rotated there. Rows that no tier gave stay unknown: the forward
computes them like any uncached token. A segment's first `sink_tokens` are always computed: a
segment computed alone made its first token the attention sink, a role it has lost in the
prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvtier.blend.rope import RotaryTable
from kvtier.blend.segments import Segment
from kvtier.engine.segments import SegmentStore
from kvtier.keys import KeyChain

__all__ = ["Assembled", "assemble"]


class Assembled(NamedTuple):
    """`kv`: [2, layers, T, kv_width] (rows of uncached tokens undefined); `cached`: which rows
    hold loaded KV; `must`: tokens to compute although cached; `segments_hit`: segments that
    gave at least one token."""

    kv: torch.Tensor
    cached: torch.Tensor
    must: torch.Tensor
    segments_hit: int

    @property
    def tokens_cached(self) -> int:
        return int(self.cached.sum())


def assemble(store: SegmentStore, rope: RotaryTable, tokens: Sequence[int] | torch.Tensor,
             segments: Sequence[Segment], *, num_layers: int, num_kv_heads: int,
             head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
             salt: str = "", sink_tokens: int = 1,
             chains: Sequence[KeyChain] | None = None) -> Assembled:
    """The known KV of `tokens` from the segments some tier holds (see the module docstring).
    `chains`: each segment's key chain (`store.chain(tokens, segment, salt)`), when the
    caller built them already; `salt` is then unused.

    Raises:
        ValueError: `sink_tokens` < 0, a segment outside `tokens`, or `chains` not one per
            segment.
    """
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
    if chains is not None and len(chains) != len(segments):
        raise ValueError(f"{len(chains)} chains for {len(segments)} segments")
    T = len(tokens)
    width = num_kv_heads * head_dim
    kv = torch.empty(2, num_layers, T, width, dtype=dtype, device=device)
    cached = torch.zeros(T, dtype=torch.bool, device=device)
    must = torch.zeros(T, dtype=torch.bool, device=device)
    hit = 0
    for i, seg in enumerate(segments):
        if not 0 <= seg.start < seg.end <= T:
            raise ValueError(f"segment {tuple(seg)} lies outside the {T} tokens")
        rows = kv[:, :, seg.start:seg.end]
        got = store.load(store.chain(tokens, seg, salt) if chains is None else chains[i], rows)
        if not got:
            continue
        hit += 1
        keys = rows[0, :, :got].reshape(num_layers * got, num_kv_heads, head_dim)
        shift = torch.full((num_layers * got,), seg.start, dtype=torch.long, device=kv.device)
        rows[0, :, :got] = rope.rerotate(keys, shift).reshape(num_layers, got, width)
        cached[seg.start:seg.start + got] = True
        must[seg.start:seg.start + min(sink_tokens, got)] = True
    return Assembled(kv, cached, must, hit)
