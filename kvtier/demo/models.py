"""Locally generated Hugging Face models with random weights (no hub access needed).

The demo serves a random-weight Llama large enough that recomputing a long prefix costs real
time; the tests serve tiny ones. Everything is deterministic (fixed seeds, fixed corpus), so two
generations of the same spec hold identical weights: a server restarted on a regenerated model
still hits KV stored before, which the tests rely on.

`cached_llama(spec)` builds a model once under the user's cache directory, in a directory named
after the spec's digest, so changing the spec builds a new one and an unchanged spec is reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LlamaSpec", "make_tokenizer", "make_llama", "make_deepseek_mla", "cached_llama",
           "cache_root", "build_once", "SPECIAL_TOKENS"]

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
VOCAB_SIZE = 512
# Bump when the generator changes what it writes for the same spec (invalidates cached models).
GENERATOR_VERSION = 1
_MARKER = "kvtier-model.json"
_WORDS = (
    "the a cache key value layer token chunk prefix tier disk redis memory page model server "
    "request store load hit miss evict write read fast slow shared restart instance prompt "
    "answer question system user assistant long short first last every never always again"
).split()
_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class LlamaSpec:
    """The shape of a generated Llama; heads are 64 wide, `kv_heads` divides `heads` (GQA)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    max_positions: int = 2048
    seed: int = 0
    dtype: str = "float32"  # the dtype of the saved weights (bfloat16 halves the disk size)

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads "
                             f"({self.heads}), and heads of kv_heads ({self.kv_heads})")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def digest(self) -> str:
        data = {**dataclasses.asdict(self), "generator": GENERATOR_VERSION}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]

    def name(self) -> str:
        return f"llama-h{self.hidden}-l{self.layers}-{self.digest()}"


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


def make_llama(out_dir: Path, *, layers: int = 2, hidden: int = 64, seed: int = 0,
               spec: LlamaSpec | None = None) -> Path:
    """A random-weight Llama in `out_dir`: `spec`, or a tiny one (4 query heads, 2 KV heads)
    with `layers`, `hidden` and `seed`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if spec is None:
        spec = LlamaSpec(hidden=hidden, layers=layers, intermediate=2 * hidden, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out_dir)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_positions,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
        dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg)
    model.to(getattr(torch, spec.dtype)).save_pretrained(str(out_dir))
    return out_dir


def make_deepseek_mla(out_dir: Path, *, layers: int = 2, seed: int = 0) -> Path:
    """A tiny DeepSeek-V3-style MLA model (dense layers only) with random weights."""
    import torch
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
        dtype="float32",
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


def cache_root() -> Path:
    """Where generated models live: `$KVTIER_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtier`, else
    `~/.cache/kvtier`; models go in its `models/` subdirectory."""
    explicit = os.environ.get("KVTIER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtier"


def cached_llama(spec: LlamaSpec, root: Path | None = None) -> tuple[Path, bool]:
    """The model for `spec` under `root/models/` (default `cache_root()`), built if missing.

    Returns (path, built). The model is written to a temporary directory beside its final one
    and renamed into place, so an interrupted build never leaves a half model that looks ready.
    """
    marker = {**dataclasses.asdict(spec), "generator": GENERATOR_VERSION}
    return build_once((root or cache_root()) / "models" / spec.name(),
                      lambda out: make_llama(out, spec=spec), marker)


def build_once(target: Path, build: Callable[[Path], object],
               marker: dict[str, object]) -> tuple[Path, bool]:
    """`target`, built by `build(directory)` unless a finished build is there; (path, built).

    The build writes to a temporary directory beside `target`, which is renamed into place
    with `marker` written last, so an interrupted build never looks ready and two concurrent
    builds leave one finished model.
    """
    if (target / _MARKER).is_file():
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _MARKER).is_file():  # not a concurrent build that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, True


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1])
    make_llama(target / "tiny-llama")
    make_deepseek_mla(target / "tiny-mla")
    print(target)
