"""Which model a server's KV belongs to, as one key component: the served name, and a
fingerprint of everything else that changes the KV under that name (the weights themselves,
config.json, revision, load format, quantization, dtypes, overrides)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.integration.sglang.launch.weights import weights_digest
from kvtier.keys import model_component

if TYPE_CHECKING:
    from kvtier.integration.sglang.boundary.sglang_views import ServerArgsView

__all__ = ["model_key_name", "model_fingerprint", "model_identity", "served_model_name",
           "weights_digest", "weights_dir", "weights_unverified", "model_config"]


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


def model_identity(server_args: ServerArgsView, fingerprint: str | None = None) -> str:
    """A server's model as one key component: `model_key_name(served name,
    model_fingerprint(server_args))`. The radix-cache backend and the HiCache backend both key
    on it, so neither shares KV across weights, revisions or dtypes under one name.
    `fingerprint`: the config's `model_fingerprint`, used instead of the computed one."""
    return model_key_name(served_model_name(server_args),
                          fingerprint or model_fingerprint(server_args))


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
    """What else makes two servers of one model name compute different KV: the weights (every
    byte of every weights file, `weights.weights_digest`; a hub id: its local snapshot's), the
    model's config.json, its revision, load format, quantization, dtype and override
    arguments. 16 hex digits of their SHA-256."""
    import hashlib
    import json
    import os

    path = str(getattr(server_args, "model_path", "") or "")
    config_json = os.path.join(path, "config.json")
    parts: dict[str, str] = {
        name: str(getattr(server_args, name, None))
        for name in ("revision", "quantization", "dtype", "json_model_override_args",
                     "kv_cache_dtype", "load_format")}
    try:
        with open(config_json, "rb") as f:
            parts["config.json"] = hashlib.sha256(f.read()).hexdigest()
    except OSError:  # a hub name: its revision (above) names the weights
        parts["model_path"] = path
    local = weights_dir(server_args)
    weights = weights_digest(local) if local else None
    if weights is not None:
        parts["weights"] = weights
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def weights_dir(server_args: ServerArgsView) -> str | None:
    """The local directory holding the model's weights: `--model-path` itself, or a hub id's
    downloaded snapshot; None when neither is there."""
    import os

    path = str(getattr(server_args, "model_path", "") or "")
    if os.path.isdir(path):
        return path
    return _hub_snapshot(path, getattr(server_args, "revision", None))


def weights_unverified(server_args: ServerArgsView) -> str | None:
    """Why the model's weights cannot be read for a full digest (and so cannot be told apart
    from other weights served under the same name), or None when they can."""
    from kvtier.integration.sglang.launch.weights import weight_files

    local = weights_dir(server_args)
    if local is None:
        return (f"--model-path {getattr(server_args, 'model_path', '')!r} is neither a local "
                f"directory nor a downloaded hub snapshot")
    if not weight_files(local):
        return f"{local} holds no weights file (.safetensors, .bin, .pt, .pth, .gguf)"
    return None


def _hub_snapshot(model_id: str, revision: str | None) -> str | None:
    """The local snapshot directory of hub model `model_id` at `revision` (its commit, when
    SGLang resolved a branch or tag), or None when it is not downloaded (or not a hub id)."""
    if not model_id or model_id.startswith(("/", ".")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model_id, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, not downloaded, no huggingface_hub: the id and revision
        return None
