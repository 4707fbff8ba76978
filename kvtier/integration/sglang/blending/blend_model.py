"""The served model as `kvtier.blend` reads it: SGLang's own weight tensors (no copies), and
the separator as token ids. Every model blending cannot compute exactly is refused by name."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.blend.forward import LayerWeights, LlamaWeights
from kvtier.blend.rope import RotaryTable
from kvtier.errors import ConfigError
from kvtier.integration.sglang.boundary.sglang_views import Opaque

__all__ = ["BLENDABLE", "served_weights", "separator_ids"]

# SGLang model classes whose decoder is the one `kvtier.blend.forward` computes.
BLENDABLE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def _refuse(why: str) -> ConfigError:
    return ConfigError(f"enable_blending: {why}; drop enable_blending for this model")


def served_weights(model: Opaque) -> LlamaWeights:
    """`model`'s tensors as `LlamaWeights`; `ConfigError` for a model blending cannot compute
    (another architecture, a sliding window, packed or quantized weights, non-linear RoPE)."""
    name = type(model).__name__
    if name not in BLENDABLE:
        raise _refuse(f"kvtier blends {', '.join(BLENDABLE)} models, not {name}")
    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise _refuse(f"the model attends through a sliding window of {config.sliding_window} "
                      "tokens, which re-rotated segments do not model")
    inner = model.model
    layers = [_layer(i, layer) for i, layer in enumerate(inner.layers)]
    attn = inner.layers[0].self_attn
    rotary = attn.rotary_emb
    rope = RotaryTable.from_cos_sin_cache(rotary.cos_sin_cache, bool(rotary.is_neox_style))
    try:
        rope.check()
    except ValueError as exc:
        raise _refuse(f"its rotary embedding ({type(rotary).__name__}) {exc}") from None
    return LlamaWeights(
        embed=inner.embed_tokens.weight, layers=tuple(layers), norm=inner.norm.weight,
        lm_head=model.lm_head.weight, num_heads=int(attn.num_heads),
        num_kv_heads=int(attn.num_kv_heads), head_dim=int(attn.head_dim),
        eps=float(inner.layers[0].input_layernorm.variance_epsilon), rope=rope)


def _layer(index: int, layer: Opaque) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    linears = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj,
               "gate_up_proj": mlp.gate_up_proj, "down_proj": mlp.down_proj}
    for what, linear in linears.items():
        weight = getattr(linear, "weight", None)
        if getattr(linear, "use_intel_amx_backend", False):
            raise _refuse(f"layer {index}'s {what} is packed for Intel AMX kernels")
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() \
                or weight.dim() != 2 or weight.element_size() < 2:
            raise _refuse(f"layer {index}'s {what} is not a plain floating-point matrix "
                          "(quantized weights)")
    bias = getattr(attn.qkv_proj, "bias", None)
    return LayerWeights(ln_in=layer.input_layernorm.weight, qkv=attn.qkv_proj.weight,
                        o=attn.o_proj.weight, ln_post=layer.post_attention_layernorm.weight,
                        gate_up=mlp.gate_up_proj.weight, down=mlp.down_proj.weight,
                        qkv_bias=bias if isinstance(bias, torch.Tensor) else None)


def separator_ids(tokenizer: Opaque, text: str) -> tuple[int, ...]:
    """`text` as token ids. When it holds visible text, leading and trailing whitespace-only
    tokens are dropped: in a prompt they merge with the neighbouring words, so only the inner
    tokens recur where `text` does (a separator of whitespace alone, "\n\n", is kept whole).

    Raises:
        ConfigError: `text` tokenizes to nothing.
    """
    ids: Sequence[int] = tokenizer.encode(text, add_special_tokens=False)
    out = list(ids)
    if text.strip():
        while out and not tokenizer.decode([out[0]]).strip():
            out.pop(0)
        while out and not tokenizer.decode([out[-1]]).strip():
            out.pop()
    if not out:
        raise ConfigError(f"blend_special_str: {text!r} tokenizes to no token")
    return tuple(out)
