"""Every check an SGLang launch with kvtier runs before any worker starts, collected: the
launcher refuses with all of them in one message, and `kvtier check-config` (given the launch's
flags) prints the same list on the host it runs on, so a config is fixed in one pass.

The checks take SGLang's parsed arguments (or anything with the same attribute names:
`check-config` builds one from its own flags) and read this host; they write nothing.

On `--device cpu` the serving engine's KV pool and weights live in host memory and are
allocated before kvtier's arena, so the arena is checked against the memory available now less
what the engine will take (`engine_host_bytes`: the pool from `--max-total-tokens` and the
model's config.json, the weights from the checkpoint files' sizes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from kvtier.config import Config
from kvtier.config.host import MEMORY_HEADROOM_BYTES, available_memory_bytes, host_problems
from kvtier.config.tiers import lower_tier_names, tier_problem
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.integration.sglang.boundary.sglang_views import ServerArgsView

__all__ = ["Preflight", "preflight", "engine_host_bytes", "page_size_problem"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "fp8_e4m3": 1, "fp8_e5m2": 1}


class Preflight(NamedTuple):
    """`problems`: what stops the launch, each starting with the key or flag to change.
    `notes`: what the launch cannot judge and says so (it starts anyway)."""

    problems: list[str]
    notes: list[str]


def preflight(config: Config, args: ServerArgsView, *,
              available: int | None = None) -> Preflight:
    """Every launch check of `config` with SGLang arguments `args` on this host (`available`:
    bytes of memory available now, default `available_memory_bytes()`)."""
    from kvtier.backends import check_dependencies
    from kvtier.keys.record_keys import load_record_keys

    problems: list[str] = []
    notes: list[str] = []
    tp_size = int(getattr(args, "tp_size", None) or 1)
    dp_size = int(getattr(args, "dp_size", None) or 1)
    page_size = int(getattr(args, "page_size", None) or 1)
    problems += filter(None, [page_size_problem(config, page_size)])
    for tier in config.tiers:
        _collect(problems, check_dependencies, tier)
    problems += host_problems(config, local_ranks=tp_size * dp_size, disk=False)  # memory
    problems += filter(None, (tier_problem(tier, config) for tier in config.tiers))  # disk
    _collect(problems, load_record_keys, config.record_key_file)
    load_format = str(getattr(args, "load_format", None) or "auto")
    lower = [tier for tier in config.tiers if tier in lower_tier_names()]
    problems += filter(None, [_unverified_weights_problem(config, args, lower, load_format)])
    if load_format == "dummy" and lower:
        problems.append(f"--load-format dummy (random weights) with the {'/'.join(lower)} "
                        "tier: its KV would be stored under the model's name and loaded by "
                        "real servers of that model; use local_cpu only (drop local_disk and "
                        "remote_url) for a dummy-weights run")
    if config.metrics_port is not None and config.metrics_port + tp_size - 1 > 65535:
        problems.append(f"metrics_port: {config.metrics_port} + TP rank (up to {tp_size - 1}) "
                        f"passes 65535: each rank serves on metrics_port + rank; use at most "
                        f"{65536 - tp_size}")
    problems += filter(None, [_memory_now(config, args, tp_size * dp_size, available, notes)])
    problems += filter(None, [blend_problem(config, args, tp_size, dp_size)])
    return Preflight(problems, notes)


def blend_problem(config: Config, args: ServerArgsView, tp_size: int,
                  dp_size: int = 1) -> str | None:
    """What stops `enable_blending` on this launch, read from the flags and config.json (the
    served model's tensors are checked again once loaded, `blend_model.served_weights`, and
    at tensor parallel above 1 `blend_setup` checks the attention backend)."""
    if not config.enable_blending:
        return None
    from kvtier.integration.sglang.blending.blend_model import BLENDABLE
    from kvtier.integration.sglang.launch.identity import model_config

    if dp_size > 1:
        return ("enable_blending: blending runs at --dp 1 only (each replica would blend "
                "apart); drop enable_blending or --dp")
    if tp_size > 1 and not (config.blend.in_forward and config.cpu_prefix_attention
                            and str(getattr(args, "device", "")) == "cpu"):
        return (f"enable_blending at --tp {tp_size}: the recompute must run in SGLang's "
                "forward, on its CPU engine (--device cpu, blend_in_forward and "
                "cpu_prefix_attention true); drop enable_blending or --tp")
    if tp_size > 1 and (len(config.blend.check_layers) != 1 or config.blend.check_layers[0] < 0):
        return (f"blend_check_layers: {list(config.blend.check_layers)}: at --tp {tp_size} "
                "blending takes one check layer, from 0")
    model = model_config(args)
    archs = model.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if "kv_lora_rank" in model:
        return ("enable_blending: an MLA model (kv_lora_rank in config.json) has no per-head "
                "keys to re-rotate; drop enable_blending for this model")
    if arch is not None and arch not in BLENDABLE:
        return (f"enable_blending: kvtier blends {', '.join(BLENDABLE)} models, not {arch}; "
                "drop enable_blending for this model")
    if model.get("sliding_window") and model.get("use_sliding_window", True):
        return (f"enable_blending: the model attends through a sliding window of "
                f"{model['sliding_window']} tokens, which re-rotated segments do not model; "
                "drop enable_blending for this model")
    return None


def _unverified_weights_problem(config: Config, args: ServerArgsView, lower: list[str],
                                load_format: str) -> str | None:
    """Shared tiers keep KV under the model's name and a digest of its weights: weights kvtier
    cannot read would let a server of other weights under the same name load this KV."""
    if not lower or config.allow_unverified_weights or load_format == "dummy" \
            or not getattr(args, "model_path", None):
        return None
    from kvtier.integration.sglang.launch.identity import weights_unverified

    why = weights_unverified(args)
    if why is None:
        return None
    return (f"allow_unverified_weights: the {'/'.join(lower)} tier keeps KV that other servers "
            f"load by model name and weights digest, but {why}; point --model-path at the "
            f"weights, or set allow_unverified_weights: true to share KV by name and revision "
            f"only")


def page_size_problem(config: Config, page_size: int) -> str | None:
    """Why chunks of `config` are not whole pages of `page_size` tokens (a load must never
    split a page), or None."""
    if page_size >= 1 and config.chunk_size % page_size == 0:
        return None
    return (f"chunk_size: {config.chunk_size} must be a multiple of SGLang's --page-size "
            f"({page_size}); set chunk_size to a multiple of {page_size}")


def _collect(problems: list[str], check: Callable[..., object], *args: object) -> None:
    try:
        check(*args)
    except ConfigError as exc:
        problems.append(str(exc))


def _memory_now(config: Config, args: ServerArgsView, ranks: int, available: int | None,
                notes: list[str]) -> str | None:
    """Why the arenas do not fit the memory available now beside what SGLang's CPU engine
    takes first (its pool and weights; nothing on a GPU server), or None."""
    avail = available_memory_bytes() if available is None else available
    engine, what = 0, ""
    if str(getattr(args, "device", None) or "") == "cpu":
        if getattr(args, "max_total_tokens", None) is None:
            notes.append("--device cpu without --max-total-tokens: SGLang sizes its KV pool to "
                         "most of this host's memory, and kvtier's arena is allocated after it; "
                         "give --max-total-tokens so both are known to fit")
        elif (found := engine_host_bytes(args)) is None:
            notes.append("no config.json under --model-path: the memory of SGLang's CPU "
                         "engine is not counted here (the arena is checked again when it is "
                         "allocated)")
        else:
            engine = found
            what = (f" + about {engine / 1e9:.2f} GB for SGLang's CPU KV pool "
                    f"(--max-total-tokens {args.max_total_tokens}) and weights")
    if avail is None:
        return None
    arenas = config.max_local_cpu_size * 1e9 * ranks
    need = arenas + engine + MEMORY_HEADROOM_BYTES * ranks
    if need <= avail:
        return None
    room = max(0.0, (avail - engine) / ranks - MEMORY_HEADROOM_BYTES)
    return (f"max_local_cpu_size: {config.max_local_cpu_size:g} GB x {ranks} rank(s) of arena"
            f"{what} + {MEMORY_HEADROOM_BYTES / 1e9:.2f} GB kept free per rank = "
            f"{need / 1e9:.2f} GB, more than the {avail / 1e9:.2f} GB of memory available now: "
            f"at most {room / 1e9:.2f} GB per rank")


def engine_host_bytes(args: ServerArgsView) -> int | None:
    """About how many bytes of host memory SGLang's CPU engine takes before kvtier's arena:
    its KV pool (`--max-total-tokens` tokens of every layer's K and V, per DP rank) and the
    weights (the checkpoint files' sizes, per DP rank). None without a readable config.json
    under `--model-path`."""
    path = str(getattr(args, "model_path", None) or "")
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            model = json.load(f)
        layers = int(model["num_hidden_layers"])
        heads = int(model["num_attention_heads"])
        kv_heads = int(model.get("num_key_value_heads") or heads)
        head_dim = int(model.get("head_dim") or int(model["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    if model.get("kv_lora_rank"):  # MLA: one latent vector and its rope part per token
        per_token = layers * (int(model["kv_lora_rank"]) + int(model.get("qk_rope_head_dim", 0)))
    else:
        per_token = 2 * layers * kv_heads * head_dim
    if args.max_total_tokens is None:  # the caller checks it: SGLang sizes the pool itself
        raise ValueError("max_total_tokens: needed to size the CPU engine's KV pool")
    pool = int(args.max_total_tokens) * per_token * _kv_dtype_bytes(args, model)
    weights = sum(e.stat().st_size for e in os.scandir(path)
                  if e.is_file() and e.name.endswith(_WEIGHT_SUFFIXES))
    return (pool + weights) * int(getattr(args, "dp_size", None) or 1)


def _kv_dtype_bytes(args: object, model: dict[str, object]) -> int:
    for name in (getattr(args, "kv_cache_dtype", None), getattr(args, "dtype", None),
                 model.get("torch_dtype"), model.get("dtype")):
        if isinstance(name, str) and name not in ("auto", ""):
            return _DTYPE_BYTES.get(name.removeprefix("torch."), 2)
    return 2
