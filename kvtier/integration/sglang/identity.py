"""Which model a server's KV belongs to, as one key component: the served name, and a
fingerprint of everything else that changes the KV under that name (the weights themselves,
config.json, revision, load format, quantization, dtypes, overrides)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.keys import model_component

if TYPE_CHECKING:
    from kvtier.integration.sglang.sglang_views import ServerArgsView

__all__ = ["model_key_name", "model_fingerprint", "model_identity", "served_model_name",
           "weights_digest", "model_config"]


def model_key_name(name: str, fingerprint: str = "") -> str:
    """`name` (a served model name or path) as one key component: percent-encoded (so
    different names stay different keys, and `kvtier ls --model` takes the name as given),
    with the model's `fingerprint` (`model_fingerprint`) after an `@`."""
    if not name:
        raise ConfigError(f"model name: cannot derive a key component from {name!r}")
    return model_component(name, fingerprint)


def served_model_name(server_args: ServerArgsView) -> str:
    """The name a server's KV is keyed under: `--served-model-name`, else `--model-path`."""
    return str(getattr(server_args, "served_model_name", None) or server_args.model_path)


def model_identity(server_args: ServerArgsView) -> str:
    """A server's model as one key component: `model_key_name(served name,
    model_fingerprint(server_args))`. The radix-cache backend and the HiCache backend both key
    on it, so neither shares KV across weights, revisions or dtypes under one name."""
    return model_key_name(served_model_name(server_args), model_fingerprint(server_args))


def model_config(server_args: ServerArgsView) -> dict[str, object]:
    """The model's config.json (its text model's, for a multimodal one); {} when the model
    path is not a local directory with a readable one."""
    import json
    import os

    path = os.path.join(str(getattr(server_args, "model_path", "") or ""), "config.json")
    try:
        with open(path, "rb") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    return text if isinstance(text, dict) and "hidden_size" in text else config


def model_fingerprint(server_args: ServerArgsView) -> str:
    """What else makes two servers of one model name compute different KV: the weights (a
    sample of each local safetensors file, `weights_digest`), the model's config.json, its
    revision, load format, quantization, dtype and override arguments. 16 hex digits of their
    SHA-256."""
    import hashlib
    import json
    import os

    path = str(getattr(server_args, "model_path", "") or "")
    config_json = os.path.join(path, "config.json")
    parts: dict[str, Any] = {
        name: str(getattr(server_args, name, None))
        for name in ("revision", "quantization", "dtype", "json_model_override_args",
                     "kv_cache_dtype", "load_format")}
    try:
        with open(config_json, "rb") as f:
            parts["config.json"] = hashlib.sha256(f.read()).hexdigest()
    except OSError:  # a hub name: its revision (above) names the weights
        parts["model_path"] = path
    weights = weights_digest(path) if os.path.isdir(path) else None
    if weights is not None:
        parts["weights"] = weights
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# Bytes read from each weights file: its safetensors header plus this many evenly spaced
# samples. Two checkpoints of one training run share every header (same names, shapes and
# offsets) but no tensor data; a few hundred KiB per file tell them apart in milliseconds.
WEIGHT_SAMPLES = 16
WEIGHT_SAMPLE_BYTES = 4096
MAX_HEADER_BYTES = 1 << 24


def weights_digest(model_dir: str) -> str | None:
    """A digest of the `*.safetensors` files in `model_dir` (names, sizes, headers, and
    `WEIGHT_SAMPLES` samples of their data), or None when there are none."""
    import hashlib
    import os
    import struct

    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        return None
    digest = hashlib.sha256()
    for name in names:
        with open(os.path.join(model_dir, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(f"{name}\0{size}\0".encode())
            head = f.read(8)
            header = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            digest.update(head + f.read(min(header, MAX_HEADER_BYTES)))
            for i in range(WEIGHT_SAMPLES):
                f.seek(size * i // WEIGHT_SAMPLES)
                digest.update(f.read(WEIGHT_SAMPLE_BYTES))
    return digest.hexdigest()
