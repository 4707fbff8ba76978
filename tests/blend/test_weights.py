"""`load_llama`: a Hugging Face directory read into `LlamaWeights`, and refusals by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvtier.blend.forward import LlamaWeights, prefill
from kvtier.blend.weights import load_llama

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 96,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "vocab_size": 101}


def _write(root: Path, llama: LlamaWeights, **overrides: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**BASE, **overrides}))
    d = llama.head_dim
    sd = {"model.embed_tokens.weight": llama.embed, "model.norm.weight": llama.norm,
          "lm_head.weight": llama.lm_head}
    for i, lw in enumerate(llama.layers):
        p = f"model.layers.{i}"
        q, k, v = lw.qkv.split([4 * d, 2 * d, 2 * d])
        gate, up = lw.gate_up.chunk(2)
        sd.update({f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.k_proj.weight": k,
                   f"{p}.self_attn.v_proj.weight": v, f"{p}.self_attn.o_proj.weight": lw.o,
                   f"{p}.mlp.gate_proj.weight": gate, f"{p}.mlp.up_proj.weight": up,
                   f"{p}.mlp.down_proj.weight": lw.down,
                   f"{p}.input_layernorm.weight": lw.ln_in,
                   f"{p}.post_attention_layernorm.weight": lw.ln_post})
    save_file({k: t.contiguous() for k, t in sd.items()}, str(root / "model.safetensors"))
    return root


def test_a_directory_loads_into_the_same_model(llama: LlamaWeights, tmp_path: Path) -> None:
    loaded = load_llama(_write(tmp_path / "m", llama))
    toks = torch.arange(1, 40)
    a, b = prefill(llama, toks), prefill(loaded, toks)
    assert torch.equal(a.kv, b.kv)
    assert a.logits is not None and b.logits is not None
    assert torch.allclose(a.logits, b.logits, atol=1e-5)  # another buffer alignment: rounding


@pytest.mark.parametrize(("overrides", "message"), [
    ({"architectures": ["DeepseekV2ForCausalLM"]}, "DeepseekV2ForCausalLM cannot be blended"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
])
def test_what_cannot_be_blended_is_refused_by_name(
        llama: LlamaWeights, tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_llama(_write(tmp_path / "m", llama, **overrides))
