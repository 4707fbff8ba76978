"""A Llama-family forward pass over plain weight tensors: in full, or blended.

`prefill` computes every token in every layer: the reference. `blend` starts from KV that is
already known for some tokens (segments loaded from the tiers, keys re-rotated to where they now
stand), computes every token in the layers up to the check layer, and there keeps only the
tokens that must be computed (`must`: tokens with no cached KV, a segment's first tokens, the
last token) plus the `ratio` share of cached tokens whose fresh values deviate most from the
cached ones (squared L2). Later layers compute those tokens alone; the others keep their
cached KV. Every token attends to every token before it, in every layer.

What follows from that, and what the tests check: with `ratio` 1 the result is `prefill`'s; the
KV of layers up to the check layer is always `prefill`'s, and so is the next layer's KV of every
token computed past the check layer (their input there is exact).

Weights are the model's own tensors (SGLang's, or read from safetensors): this module holds no
copies and runs on their device. Matmuls run in the weights' dtype, norms and rotation in
float32, as SGLang's native paths do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvtier.blend.rope import RotaryTable

__all__ = ["BlendPlan", "Blended", "LayerWeights", "LlamaWeights", "NAIVE", "blend", "pick",
           "prefill"]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer: fused q/k/v rows (q, then k, then v), output projection, fused
    gate/up rows (gate, then up), down projection, and the two RMSNorm weights."""

    ln_in: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    ln_post: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class LlamaWeights:
    """A decoder-only RoPE model with grouped-query attention, SwiGLU MLP and RMSNorm (Llama,
    Qwen2, Mistral without a sliding window)."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope: RotaryTable

    @property
    def kv_width(self) -> int:
        """Values per token per layer in K (and in V): kv heads x head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_layers(self) -> int:
        return len(self.layers)


class BlendPlan(NamedTuple):
    """At each of `check_layers` (increasing), keep computing the `ratios` share (of all cached
    tokens, non-increasing) of the cached tokens still computed whose fresh values deviate most
    from their cached ones: one check layer is CacheBlend's plan, several narrow it in steps
    (LMCache's `blend_check_layers` / `blend_recompute_ratios`). A check layer of -1 computes
    no cached token in any layer: naive reuse, the baseline blending improves on."""

    check_layers: tuple[int, ...] = (1,)
    ratios: tuple[float, ...] = (0.15,)

    @classmethod
    def one(cls, ratio: float, check_layer: int = 1) -> BlendPlan:
        return cls((check_layer,), (ratio,))


NAIVE = BlendPlan((-1,), (0.0,))
DEFAULT_PLAN = BlendPlan()


class Blended(NamedTuple):
    """The KV of every token (`[2, layers, tokens, kv_width]`, the weights' dtype), the last
    token's logits (None when not asked for), and the tokens computed in the last layer."""

    kv: torch.Tensor
    logits: torch.Tensor | None
    computed: torch.Tensor  # sorted token indices


def prefill(w: LlamaWeights, tokens: torch.Tensor, *, logits: bool = True,
            upto: int | None = None) -> Blended:
    """Every token of `tokens` ([T] ids) at positions 0..T-1, in every layer (with `upto`:
    in the layers up to that one only; the later layers' KV is left undefined, no logits)."""
    if upto is not None and not 0 <= upto < w.num_layers:
        raise ValueError(f"upto must be a layer in [0, {w.num_layers}), got {upto}")
    return _forward(w, tokens, None, None, None, BlendPlan((), ()), logits and upto is None,
                    upto)


def blend(w: LlamaWeights, tokens: torch.Tensor, cached_kv: torch.Tensor,
          cached: torch.Tensor, plan: BlendPlan = DEFAULT_PLAN, *,
          must: torch.Tensor | None = None, logits: bool = True,
          upto: int | None = None, in_place: bool = False) -> Blended:
    """`tokens` computed over the known KV of the tokens where `cached` ([T] bool) is set.

    Args:
        cached_kv: [2, layers, T, kv_width]: what each cached token's KV is taken to be, keys
            rotated at the token's position; rows of uncached tokens are ignored.
        cached: which tokens `cached_kv` holds.
        plan: the shares to recompute and the layers that pick them.
        must: tokens to compute in every layer whether cached or not (the last token always is).
        upto: stop after this layer's KV (a check layer or later): layers past it keep
            `cached_kv`, and `computed` names the tokens still to compute there. SGLang's
            forward computes them (`integration/sglang/blending/in_forward.py`); no logits.
        in_place: write the computed KV into `cached_kv` itself, which the caller gives up,
            where it is on the model's device in its dtype (else a copy, as by default): a
            2,500-token prompt's KV is 115 MB on SmolLM2 in float32, copied whole although
            only the layers up to `upto` change.

    Raises:
        ValueError: shapes that do not match `w` and `tokens`, a ratio outside [0, 1], a check
            layer outside the model.
    """
    T = tokens.shape[0]
    want = (2, w.num_layers, T, w.kv_width)
    if tuple(cached_kv.shape) != want:
        raise ValueError(f"cached_kv must have shape {want}, got {tuple(cached_kv.shape)}")
    if cached.shape != (T,) or cached.dtype != torch.bool:
        raise ValueError(f"cached must be a bool tensor of shape ({T},)")
    if must is not None and (must.shape != (T,) or must.dtype != torch.bool):
        raise ValueError(f"must must be a bool tensor of shape ({T},)")
    _check_plan(plan, w.num_layers)
    if upto is not None and not max(plan.check_layers) <= upto < w.num_layers:
        raise ValueError(f"upto must be a layer from the last check layer "
                         f"{max(plan.check_layers)} to {w.num_layers - 1}, got {upto}")
    return _forward(w, tokens, cached_kv, cached, must, plan, logits and upto is None, upto,
                    in_place)


def _forward(w: LlamaWeights, tokens: torch.Tensor, cached_kv: torch.Tensor | None,
             cached: torch.Tensor | None, must: torch.Tensor | None, plan: BlendPlan,
             want_logits: bool, upto: int | None = None, in_place: bool = False) -> Blended:
    if tokens.dim() != 1 or tokens.numel() == 0:
        raise ValueError(f"tokens must be a non-empty 1-D tensor, got {tuple(tokens.shape)}")
    dev = w.embed.device
    T = tokens.shape[0]
    positions = torch.arange(T, device=dev)
    kv = (torch.empty(2, w.num_layers, T, w.kv_width, dtype=w.embed.dtype, device=dev)
          if cached_kv is None else cached_kv.to(dev, w.embed.dtype, copy=not in_place))
    h = w.embed[tokens.to(dev)]
    active = positions
    steps = dict(zip(plan.check_layers, plan.ratios)) if cached is not None else {}
    if cached is not None:
        cached = cached.to(dev)
        must = ~cached if must is None else must.to(dev) | ~cached
        must[-1] = True
        if -1 in steps:
            active = must.nonzero().squeeze(1)
            h = h[active]
        total = int(cached.sum())
    mask = _mask(active)
    with torch.inference_mode():
        for layer, lw in enumerate(w.layers if upto is None else w.layers[:upto + 1]):
            q, k, v = _qkv(w, lw, _rms(h, lw.ln_in, w.eps), positions[active])
            # A check layer's loaded values, read before the write below: `kv` may be
            # `cached_kv` itself (in_place).
            loaded_v = (cached_kv[1, layer, active].to(dev)
                        if layer in steps and cached_kv is not None and must is not None
                        else None)
            kv[0, layer, active] = k
            kv[1, layer, active] = v
            if loaded_v is not None:
                assert must is not None
                keep = _select(v, loaded_v, must[active], math.ceil(steps[layer] * total))
                q, h, active = q[keep], h[keep], active[keep]
                mask = _mask(active)
            if layer == upto:
                break
            attn = _attend(q, kv[0, layer], kv[1, layer], active, mask, w)
            h = h + F.linear(attn, lw.o)
            gate, up = F.linear(_rms(h, lw.ln_post, w.eps), lw.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, lw.down)
        logits = None
        if want_logits:
            logits = F.linear(_rms(h[-1:], w.norm, w.eps), w.lm_head)[0].float()
    return Blended(kv, logits, active)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def _qkv(w: LlamaWeights, lw: LayerWeights, x: torch.Tensor, pos: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated q [n, heads, d], rotated k [n, kv_width] and v [n, kv_width]."""
    n, d = x.shape[0], w.head_dim
    q, k, v = F.linear(x, lw.qkv, lw.qkv_bias).split(
        [w.num_heads * d, w.kv_width, w.kv_width], dim=-1)
    q = w.rope.apply(q.reshape(n, w.num_heads, d), pos)
    k = w.rope.apply(k.reshape(n, w.num_kv_heads, d), pos).reshape(n, w.kv_width)
    return q, k, v


def _select(fresh_v: torch.Tensor, cached_v: torch.Tensor, must: torch.Tensor,
            budget: int) -> torch.Tensor:
    """Indices (sorted) into the computed tokens of those to keep computing: every `must`
    token, and the `budget` others whose fresh values deviate most from their cached values.
    Values, not keys: on SmolLM2-135M (4 queries of 4 shuffled documents, 15% share, check
    layer 1), ranking by value deviation left 0.22-0.48 of naive reuse's KL, keys and values
    0.42-0.61, keys alone 0.41-0.61, each normalized by its mean norm 0.31-0.61
    (benchmarks/LOG.md)."""
    return pick((fresh_v.float() - cached_v.float()).pow(2).sum(dim=-1), must, budget)


def pick(deviation: torch.Tensor, must: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices (sorted) of every `must` token and of the `budget` others of largest
    `deviation` ([n] each): `_select`'s choice, from deviations summed elsewhere (the ranks
    of a tensor-parallel server each hold some heads' values)."""
    keep = must.clone()
    free = int((~keep).sum())
    if budget and free:
        dev = deviation.clone()
        dev[keep] = -1.0  # already kept: never spend the budget on them
        keep[torch.topk(dev, min(budget, free)).indices] = True
    return keep.nonzero().squeeze(1)


def _check_plan(plan: BlendPlan, num_layers: int) -> None:
    layers, ratios = plan.check_layers, plan.ratios
    if len(layers) != len(ratios) or not layers:
        raise ValueError(f"check_layers and ratios must be non-empty and of one length, got "
                         f"{layers} and {ratios}")
    if any(not -1 <= x < num_layers for x in layers) or list(layers) != sorted(set(layers)):
        raise ValueError(f"check_layers must increase within [-1, {num_layers}), got {layers}")
    if any(not 0.0 <= r <= 1.0 for r in ratios) or list(ratios) != sorted(ratios, reverse=True):
        raise ValueError(f"ratios must lie in [0, 1] and not increase, got {ratios}")


ATTENTION_BLOCKS = 4  # query blocks, each over the keys up to its last query


class _Block(NamedTuple):
    start: int  # the block's queries: [start, stop) of the computed tokens
    stop: int
    span: int  # keys [0, span) are before or at one of its queries
    mask: torch.Tensor  # [stop - start, span], additive: 0 or -inf


def _mask(qpos: torch.Tensor) -> list[_Block] | None:
    """The additive causal masks of queries at `qpos` (increasing), in blocks of queries that
    each attend only to the keys up to their last query: scattered queries see half the keys
    on average, and one mask over all of them would compute the other half for nothing. None
    when the queries are every position up to the last: the plain causal mask. Built once per
    set of queries, not per layer."""
    n, span = qpos.numel(), int(qpos[-1]) + 1
    if n == span:
        return None
    bounds = sorted({round(i * n / ATTENTION_BLOCKS) for i in range(ATTENTION_BLOCKS + 1)})
    blocks = []
    for start, stop in zip(bounds, bounds[1:]):
        end = int(qpos[stop - 1]) + 1
        allowed = torch.arange(end, device=qpos.device)[None, :] <= qpos[start:stop, None]
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=qpos.device)
        blocks.append(_Block(start, stop, end, mask.masked_fill_(~allowed, float("-inf"))))
    return blocks


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, qpos: torch.Tensor,
            mask: list[_Block] | None, w: LlamaWeights) -> torch.Tensor:
    """Causal attention of queries at `qpos` over every token's K/V before or at them
    (`mask`: `_mask(qpos)`). Some queries only: scores, softmax and values by hand, in
    float32, block by block, the query heads of one KV head stacked (SDPA's masked path on a
    CPU spent a third of its time converting and checking the mask)."""
    n, d = q.shape[0], w.head_dim
    span = int(qpos[-1]) + 1
    kvh, groups = w.num_kv_heads, w.num_heads // w.num_kv_heads
    k = keys[:span].reshape(span, kvh, d).transpose(0, 1)
    v = values[:span].reshape(span, kvh, d).transpose(0, 1)
    if mask is None:  # every token up to the last: the plain causal mask
        # With a batch dimension: on a CPU, 3-d inputs take SDPA's math path, which computes
        # every score (SmolLM2, 2,500 tokens, 2 threads: 0.37 s a layer against 0.045 s)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                             is_causal=True, enable_gqa=True)[0]
        return out.transpose(0, 1).reshape(n, w.num_heads * d)
    kf, vf = k.float(), v.float()
    qh = q.float().reshape(n, kvh, groups, d).permute(1, 2, 0, 3)  # [kvh, groups, n, d]
    out = torch.empty(kvh, groups, n, d, dtype=torch.float32, device=q.device)
    for b in mask:
        rows = b.stop - b.start
        qb = qh[:, :, b.start:b.stop].reshape(kvh, groups * rows, d)
        scores = torch.bmm(qb, kf[:, :b.span].transpose(1, 2)).mul_(d ** -0.5)
        scores.view(kvh, groups, rows, b.span).add_(b.mask)
        out[:, :, b.start:b.stop] = torch.bmm(scores.softmax(dim=-1), vf[:, :b.span]).view(
            kvh, groups, rows, d)
    return out.to(q.dtype).permute(2, 0, 1, 3).reshape(n, w.num_heads * d)
