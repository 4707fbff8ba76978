"""Blending on a tensor-parallel server: every rank picks the same tokens to recompute.

At TP n each rank's pool, and each rank's segment records, hold its own share of the KV heads,
while the check layers need every head: each head's attention output feeds every hidden unit
of the next layer. So:

- Every rank holds the whole model's weights, put together once at start from the ranks'
  shards (`gather_weights`: each shard placed in zeros where it belongs, then summed over the
  TP group, the one collective the tree already uses). It costs a copy of the weights per rank.
- A blend job computes the check layers over every token from those weights (the same numbers
  on every rank), keeps its own heads' columns, and measures how far its own heads' loaded
  values are from the fresh ones, per token. The ranks sum those deviations at admission and
  each picks the same rows from the sum: SGLang's extend, which folds them in, is one batch
  across the ranks and must be the same batch on each.
- Every other choice that reads a rank's own tiers (which segments are held, whether a blend
  beats the full prefill, whether its loads and its job are done) is agreed too, on the
  scheduler thread, every rank in step (`Ranks`): a rank whose tier lost a record makes all of
  them compute those tokens.
- Segments computed alone in the background are computed whole and stored as each rank's
  columns (`columns`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvtier.blend.forward import BlendPlan, LayerWeights, LlamaWeights, pick
from kvtier.integration.sglang.blending.blend_jobs import Computed

__all__ = ["Ranks", "agreed_rows", "gather_weights", "rows_to_come"]

Reduce = Callable[[torch.Tensor, str], None]  # all-reduce in place over the TP group: min, sum


class Ranks(NamedTuple):
    """This rank of a TP group of `size`, and the group's all-reduce. Every call is a
    collective: every rank makes the same calls in the same order (the scheduler thread)."""

    rank: int
    size: int
    reduce: Reduce

    def agree(self, value: bool) -> bool:
        """True when `value` holds on every rank."""
        t = torch.tensor([int(value)], dtype=torch.int64)
        self.reduce(t, "min")
        return bool(t.item())

    def least(self, values: Sequence[int]) -> list[int]:
        """Each of `values` at its smallest over the ranks."""
        if not values:
            return []
        t = torch.tensor(list(values), dtype=torch.int64)
        self.reduce(t, "min")
        return [int(x) for x in t.tolist()]

    def everywhere(self, mask: torch.Tensor) -> torch.Tensor:
        """`mask` ([n] bool) where it is set on every rank."""
        t = mask.to(torch.int32)
        self.reduce(t, "min")
        return t.bool()

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """`values` ([n]) summed over the ranks, in float64 (the same sum on every rank)."""
        t = values.to(torch.float64)
        self.reduce(t, "sum")
        return t

    def columns(self, local_width: int) -> slice:
        """This rank's columns of a KV row of the whole model (`local_width` a rank)."""
        return slice(self.rank * local_width, (self.rank + 1) * local_width)


def gather_weights(local: LlamaWeights, ranks: Ranks, vocab: int) -> LlamaWeights:
    """The whole model from every rank's shard `local` (SGLang's tensor-parallel layout:
    q, k and v rows per rank in the fused projection, gate and up rows in the other, the
    output and down projections split by columns, the embedding by rows when it is
    sharded). Heads padded by SGLang for a TP size that does not divide them stay, as zeros:
    they add nothing, and each rank's columns are where its pool has its heads."""

    def whole(shard: torch.Tensor, dim: int) -> torch.Tensor:
        shape = list(shard.shape)
        step = shape[dim]
        shape[dim] = step * ranks.size
        out = torch.zeros(shape, dtype=shard.dtype, device=shard.device)
        out.narrow(dim, ranks.rank * step, step).copy_(shard)
        ranks.reduce(out, "sum")  # zeros elsewhere: the sum is the concatenation
        return out

    def rows(fused: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        return torch.cat([whole(part, 0) for part in fused.split(list(sizes), dim=0)])

    d = local.head_dim
    qkv_rows = (local.num_heads * d, local.num_kv_heads * d, local.num_kv_heads * d)
    layers = []
    for lw in local.layers:
        half = lw.gate_up.shape[0] // 2
        layers.append(LayerWeights(
            ln_in=lw.ln_in, qkv=rows(lw.qkv, qkv_rows), o=whole(lw.o, 1), ln_post=lw.ln_post,
            gate_up=rows(lw.gate_up, (half, half)), down=whole(lw.down, 1),
            qkv_bias=None if lw.qkv_bias is None else rows(lw.qkv_bias, qkv_rows)))
    embed = local.embed
    if embed.shape[0] < vocab:  # split by rows (the vocabulary padded to the TP size)
        embed = whole(embed, 0)
    # Blends on a tensor-parallel server stop at the check layers and segments need no
    # logits: the head is never read, and the embedding stands in for it.
    return LlamaWeights(embed, tuple(layers), local.norm, embed, local.num_heads * ranks.size,
                        local.num_kv_heads * ranks.size, d, local.eps, local.rope)


def agreed_rows(done: Computed | None, ranks: Ranks, plan: BlendPlan) -> Computed | None:
    """A tensor-parallel blend's rows to recompute, the same on every rank: the tokens some
    rank's tiers did not give count as uncached everywhere, the deviations are summed, and
    the plan's share of the cached tokens that deviate most is picked (`forward.pick`). None
    on every rank when some rank has no blend (its job failed or was dropped). Collectives
    in a fixed order whatever this rank holds: call it on every rank in step."""
    if not ranks.agree(done is not None and done.deviation is not None):
        return None
    assert done is not None and done.deviation is not None
    cached = ranks.everywhere(done.cached.cpu())
    deviation = ranks.total(done.deviation.cpu())
    must = done.must.cpu() | ~cached
    must[-1] = True  # the last token of the span is always computed, as `forward.blend` does
    budget = math.ceil(plan.ratios[0] * int(cached.sum()))
    rows = pick(deviation, must, budget).to(done.cached.device)
    return done._replace(cached=cached.to(done.cached.device), computed=rows, deviation=None)


def rows_to_come(done: Computed, plan: BlendPlan) -> int:
    """The rows SGLang's extend will compute for `done` (the planner counts their time): known
    at tensor parallel 1; on a tensor-parallel rank, before `agreed_rows` picks them, those that
    must be computed and the plan's share of the rest."""
    if done.deviation is None:
        return len(done.computed)
    cached = int(done.cached.sum())
    return int((done.must | ~done.cached).sum()) + min(cached, math.ceil(plan.ratios[0] * cached))
