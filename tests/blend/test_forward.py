from __future__ import annotations

import pytest
import torch

from kvtier.blend.forward import NAIVE, BlendPlan, LlamaWeights, blend, prefill
from tests.blend.conftest import tiny_llama

T = 48


def _tokens(seed: int = 0, n: int = T) -> torch.Tensor:
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.sglang  # transformers, which `make sglang-env` installs, is the oracle
def test_prefill_matches_transformers(llama: LlamaWeights) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    d = llama.head_dim
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    sd = {"model.embed_tokens.weight": llama.embed, "model.norm.weight": llama.norm,
          "lm_head.weight": llama.lm_head}
    for i, lw in enumerate(llama.layers):
        q, k, v = lw.qkv.split([4 * d, 2 * d, 2 * d])
        gate, up = lw.gate_up.chunk(2)
        for name, t in (("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v),
                        ("self_attn.o_proj", lw.o), ("mlp.gate_proj", gate), ("mlp.up_proj", up),
                        ("mlp.down_proj", lw.down), ("input_layernorm", lw.ln_in),
                        ("post_attention_layernorm", lw.ln_post)):
            sd[f"model.layers.{i}.{name}.weight"] = t
    hf.load_state_dict(sd, strict=True)
    toks = _tokens()
    with torch.no_grad():
        out = hf(toks[None], use_cache=True)
    ours = prefill(llama, toks)
    assert torch.allclose(ours.logits, out.logits[0, -1], atol=1e-4)
    cache = out.past_key_values
    for i in range(4):
        k = cache.layers[i].keys[0].transpose(0, 1).reshape(T, -1)
        v = cache.layers[i].values[0].transpose(0, 1).reshape(T, -1)
        assert torch.allclose(ours.kv[0, i], k, atol=1e-5)
        assert torch.allclose(ours.kv[1, i], v, atol=1e-5)


def _stale_cache(llama: LlamaWeights, toks: torch.Tensor) -> torch.Tensor:
    """The KV a cache would hold for tokens 8.. computed on their own (the segment case): no
    attention to the first 8 tokens, keys re-rotated from positions 0.. to 8.."""
    kv = prefill(llama, toks, logits=False).kv.clone()
    alone = prefill(llama, toks[8:], logits=False).kv
    n = T - 8
    for layer in range(llama.num_layers):
        keys = alone[0, layer].reshape(n, llama.num_kv_heads, llama.head_dim)
        kv[0, layer, 8:] = llama.rope.rerotate(keys, 8).reshape(n, -1)
        kv[1, layer, 8:] = alone[1, layer]
    return kv


def test_ratio_one_is_prefill(llama: LlamaWeights) -> None:
    toks = _tokens()
    full = prefill(llama, toks)
    cached = torch.zeros(T, dtype=torch.bool)
    cached[8:40] = True
    out = blend(llama, toks, _stale_cache(llama, toks), cached, BlendPlan.one(1.0, 1))
    assert torch.allclose(out.kv, full.kv, atol=1e-5)
    assert torch.allclose(out.logits, full.logits, atol=1e-4)
    assert out.computed.tolist() == list(range(T))


def test_blend_is_exact_where_the_contract_says(llama: LlamaWeights) -> None:
    toks = _tokens()
    full = prefill(llama, toks).kv
    stale = _stale_cache(llama, toks)
    cached = torch.zeros(T, dtype=torch.bool)
    cached[8:40] = True
    must = torch.zeros(T, dtype=torch.bool)
    must[8] = True  # a segment's first token
    out = blend(llama, toks, stale, cached, BlendPlan.one(0.25, 1), must=must)
    kept = out.computed
    # uncached tokens, the must token, the last token, and 25% of 32 cached tokens
    assert set(range(8)) | {8} | set(range(40, T)) <= set(kept.tolist())
    assert len(kept) == 8 + 1 + 8 + 8
    assert torch.allclose(out.kv[:, :2], full[:, :2], atol=1e-5)  # layers 0..check: exact
    assert torch.allclose(out.kv[:, 2, kept], full[:, 2, kept], atol=1e-5)
    skipped = torch.tensor([i for i in range(T) if i not in set(kept.tolist())])
    assert torch.equal(out.kv[:, 2:, skipped], stale[:, 2:, skipped])  # kept as loaded
    # the picked tokens are those whose fresh layer-1 values deviate most from the stale ones
    dev = (full[1, 1] - stale[1, 1]).pow(2).sum(dim=-1)
    dev[~cached] = -1
    dev[8] = -1
    assert set(torch.topk(dev, 8).indices.tolist()) <= set(kept.tolist())


@pytest.mark.parametrize("plan", [BlendPlan.one(0.25, 1), BlendPlan((1, 2), (0.5, 0.25)), NAIVE])
def test_a_blend_stopped_after_its_check_layers_leaves_the_rest_to_the_engine(
        llama: LlamaWeights, plan: BlendPlan) -> None:
    """`upto`: what SGLang's forward is handed (in_forward.py): the KV up to the last check
    layer as the whole blend computes it, the cached KV past it, and the same tokens to
    compute there."""
    toks = _tokens(2)
    stale = _stale_cache(llama, toks)
    cached = torch.zeros(T, dtype=torch.bool)
    cached[8:40] = True
    must = torch.zeros(T, dtype=torch.bool)
    must[8] = True
    whole = blend(llama, toks, stale, cached, plan, must=must)
    last = max(plan.check_layers)
    part = blend(llama, toks, stale, cached, plan, must=must, upto=last)
    assert torch.equal(part.computed, whole.computed) and part.logits is None
    assert torch.allclose(part.kv[:, :last + 1], whole.kv[:, :last + 1], atol=1e-6)
    assert torch.equal(part.kv[:, last + 1:], stale[:, last + 1:])
    with pytest.raises(ValueError, match="upto"):
        blend(llama, toks, stale, cached, plan, upto=llama.num_layers)


@pytest.mark.parametrize("upto", [None, 2])
def test_a_blend_in_place_writes_the_callers_buffer_and_picks_the_same_tokens(
        llama: LlamaWeights, upto: int | None) -> None:
    """`in_place`: the result is the caller's `cached_kv`, equal to the copying blend's, and
    the check layers still rank tokens by their loaded values (read before they are
    overwritten: the same picks); by default the caller's buffer is left as it was."""
    toks = _tokens(3)
    stale = _stale_cache(llama, toks)
    cached = torch.zeros(T, dtype=torch.bool)
    cached[4:44] = True
    plan = BlendPlan((1, 2), (0.5, 0.25))
    copied = blend(llama, toks, stale, cached, plan, upto=upto)
    assert torch.equal(stale, _stale_cache(llama, toks))  # the default copies
    buffer = stale.clone()
    own = blend(llama, toks, buffer, cached, plan, upto=upto, in_place=True)
    assert own.kv.data_ptr() == buffer.data_ptr()
    assert torch.equal(own.computed, copied.computed)
    assert torch.equal(own.kv, copied.kv)
    assert (own.logits is None) == (upto is not None)
    if own.logits is not None and copied.logits is not None:
        assert torch.equal(own.logits, copied.logits)


def test_check_layers_narrow_in_steps(llama: LlamaWeights) -> None:
    toks = _tokens(1)
    full = prefill(llama, toks).kv
    cached = torch.zeros(T, dtype=torch.bool)
    cached[8:40] = True
    out = blend(llama, toks, _stale_cache(llama, toks), cached, BlendPlan((1, 2), (0.5, 0.25)))
    assert len(out.computed) == 8 + 8 + 8  # uncached before and after, then 25% of 32
    # computed at layer 1 (half the cached tokens): their layer-2 input, so KV, is exact
    assert torch.allclose(out.kv[:, 2, out.computed], full[:, 2, out.computed], atol=1e-5)


def test_exact_cache_blends_to_prefill_and_naive_reuse_differs(llama: LlamaWeights) -> None:
    toks = _tokens()
    full = prefill(llama, toks)
    cached = torch.zeros(T, dtype=torch.bool)
    cached[:40] = True  # a prefix: its cached KV is exactly what prefill computes
    exact = blend(llama, toks, full.kv, cached, BlendPlan.one(0.0, 1))
    assert torch.allclose(exact.kv, full.kv, atol=1e-5)
    assert torch.allclose(exact.logits, full.logits, atol=1e-4)
    naive = blend(llama, toks, _stale_cache(llama, toks), cached, NAIVE)
    assert naive.computed.tolist() == list(range(40, T))
    assert not torch.allclose(naive.logits, full.logits, atol=1e-2)


def test_blended_logits_move_toward_prefill(llama: LlamaWeights) -> None:
    toks = _tokens(3)
    full = prefill(llama, toks).logits.log_softmax(-1)
    stale = _stale_cache(llama, toks)
    cached = torch.zeros(T, dtype=torch.bool)
    cached[8:40] = True

    def kl(plan: BlendPlan) -> float:
        out = blend(llama, toks, stale, cached, plan).logits.log_softmax(-1)
        return float((full.exp() * (full - out)).sum())

    assert kl(BlendPlan.one(0.5, 1)) < kl(NAIVE)


def test_refusals_name_the_argument(llama: LlamaWeights) -> None:
    toks = _tokens()
    kv = torch.zeros(2, 4, T, llama.kv_width)
    cached = torch.zeros(T, dtype=torch.bool)
    with pytest.raises(ValueError, match="cached_kv must have shape"):
        blend(llama, toks, kv[:, :3], cached)
    with pytest.raises(ValueError, match="cached must be"):
        blend(llama, toks, kv, cached[:5])
    with pytest.raises(ValueError, match="ratios"):
        blend(llama, toks, kv, cached, BlendPlan.one(1.5, 1))
    with pytest.raises(ValueError, match="ratios must lie in"):
        blend(llama, toks, kv, cached, BlendPlan((1, 2), (0.1, 0.3)))
    with pytest.raises(ValueError, match="check_layers must increase"):
        blend(llama, toks, kv, cached, BlendPlan.one(0.1, 4))
    with pytest.raises(ValueError, match="one length"):
        blend(llama, toks, kv, cached, BlendPlan((1, 2), (0.1,)))
    with pytest.raises(ValueError, match="tokens"):
        prefill(llama, torch.tensor([], dtype=torch.long))


def test_bf16_weights_run_and_stay_close() -> None:
    f32, bf16 = tiny_llama(), tiny_llama(dtype=torch.bfloat16)
    toks = _tokens()
    a, b = prefill(f32, toks), prefill(bf16, toks)
    assert b.kv.dtype == torch.bfloat16
    assert float((a.kv - b.kv.float()).norm() / a.kv.norm()) < 5e-2
