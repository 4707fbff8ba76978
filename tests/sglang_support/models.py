"""Tiny, locally generated Hugging Face models for SGLang tests (no hub access needed).

Everything is deterministic (fixed seeds, fixed corpus), so two generations of the same model
hold identical weights: a server restarted on a regenerated model still hits stored KV only if
that is true, which the tests rely on. Generated at test time into a temporary directory.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

__all__ = ["make_tokenizer", "make_llama", "make_deepseek_mla", "SPECIAL_TOKENS"]

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
VOCAB_SIZE = 512
_WORDS = (
    "the a cache key value layer token chunk prefix tier disk redis memory page model server "
    "request store load hit miss evict write read fast slow shared restart instance prompt "
    "answer question system user assistant long short first last every never always again"
).split()
_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _corpus(seed: int = 0, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) for _ in range(lines)]


def make_tokenizer(out_dir: Path) -> int:
    """Train a byte-level BPE (vocab 512) and save it as a fast HF tokenizer; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return len(fast)


def make_llama(out_dir: Path, *, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """A tiny Llama (GQA: 4 query heads, 2 KV heads) with random weights, in `out_dir`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out_dir)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(out_dir))
    return out_dir


def make_deepseek_mla(out_dir: Path, *, layers: int = 2, seed: int = 0) -> Path:
    """A tiny DeepSeek-V3-style MLA model (dense layers only) with random weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out_dir)
    cfg = DeepseekV3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=layers, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    DeepseekV3ForCausalLM(cfg).save_pretrained(str(out_dir))
    # SGLang's CPU rope for DeepSeek asserts a yarn block; moe_layer_freq is read unconditionally.
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data["moe_layer_freq"] = 1
    data["rope_scaling"] = {
        "rope_type": "yarn", "type": "yarn", "factor": 1.0,
        "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0,
    }
    path.write_text(json.dumps(data, indent=2))
    return out_dir


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1])
    make_llama(target / "tiny-llama")
    make_deepseek_mla(target / "tiny-mla")
    print(target)
