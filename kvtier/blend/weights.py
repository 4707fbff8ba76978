"""`LlamaWeights` from a Hugging Face model directory (config.json + safetensors).

For benchmarks and tests that blend outside a server: the served model's own tensors come from
SGLang instead. What this loader cannot blend it refuses by name: another architecture, a
sliding window, a RoPE whose angles are not linear in the position.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvtier.blend.forward import LayerWeights, LlamaWeights
from kvtier.blend.rope import RotaryTable

__all__ = ["BLENDABLE", "load_llama"]

# Architectures whose attention is the one `forward` computes (GQA over RoPE, SwiGLU, RMSNorm).
BLENDABLE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_LINEAR_ROPE = ("default", "linear", "llama3")


def _rope(cfg: dict, head_dim: int) -> RotaryTable:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _LINEAR_ROPE:
        raise ValueError(f"rope type {kind!r} cannot be blended: re-rotation needs angles "
                         f"linear in the position ({', '.join(_LINEAR_ROPE)})")
    if kind != "default":
        # Linear and Llama-3 scaling compose too, but this loader builds only the plain table.
        raise ValueError(f"rope type {kind!r}: load_llama builds plain RoPE tables only")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rot = int(head_dim * cfg.get("partial_rotary_factor", 1.0))
    return RotaryTable.from_theta(rot, float(theta), int(cfg.get("max_position_embeddings",
                                                                  8192)))


def load_llama(model_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> LlamaWeights:
    """The weights of the model in `model_dir`, in `dtype` on `device`.

    Raises:
        ValueError: the architecture or its attention cannot be blended (named in the message).
    """
    root = Path(model_dir)
    cfg = json.loads((root / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in BLENDABLE:
        raise ValueError(f"{arch} cannot be blended: kvtier blends {', '.join(BLENDABLE)}")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        raise ValueError(f"{arch} with sliding_window={cfg['sliding_window']} cannot be "
                         f"blended: a re-positioned segment would see another window")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads",
                                                           cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    try:
        from safetensors import safe_open
    except ImportError:
        raise ImportError("kvtier.blend.weights reads safetensors files: pip install "
                          "safetensors (kvtier's dev extra has it)") from None
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), "pt", device="cpu") as f:
            for name in f.keys():  # safe_open is not a mapping
                tensors[name] = f.get_tensor(name).to(device, dtype)

    def get(name: str) -> torch.Tensor:
        return tensors[name]

    def bias(p: str) -> torch.Tensor | None:
        names = [f"{p}.self_attn.{x}_proj.bias" for x in "qkv"]
        return torch.cat([get(n) for n in names]) if names[0] in tensors else None

    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        layers.append(LayerWeights(
            ln_in=get(f"{p}.input_layernorm.weight"),
            qkv=torch.cat([get(f"{p}.self_attn.{x}_proj.weight") for x in "qkv"]),
            o=get(f"{p}.self_attn.o_proj.weight"),
            ln_post=get(f"{p}.post_attention_layernorm.weight"),
            gate_up=torch.cat([get(f"{p}.mlp.gate_proj.weight"), get(f"{p}.mlp.up_proj.weight")]),
            down=get(f"{p}.mlp.down_proj.weight"),
            qkv_bias=bias(p)))
    embed = get("model.embed_tokens.weight")
    head = embed if cfg.get("tie_word_embeddings") else get("lm_head.weight")
    table = _rope(cfg, head_dim)
    table = RotaryTable(table.cos.to(device), table.sin.to(device), table.neox)
    return LlamaWeights(embed, tuple(layers), get("model.norm.weight"), head, heads, kv_heads,
                        head_dim, float(cfg["rms_norm_eps"]), table)
