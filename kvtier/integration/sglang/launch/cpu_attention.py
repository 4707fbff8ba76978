"""Prefix hits that save attention work on SGLang's CPU engine (config key
`cpu_prefix_attention`, on by default).

SGLang 0.5.23's `torch_native` attention backend, the one its CPU engine runs, computes an
extend over a cached prefix as if the whole sequence were new: it builds queries for prefix +
extension, runs causal attention over all of them and keeps the extension's rows. A request
whose 4K-token prefix kvtier loaded therefore still paid a 4K x 4K attention per layer
(measured: a 4096-token prefix hit cost 1.04 s against 2.47 s for no hit), which hides what a
prefix cache, SGLang's own radix tree included, saves.

`extend_over_prefix` runs such an extend with the extension's queries only, against the
prefix's and the extension's keys, under the causal mask shifted by the prefix length: the
same attention, row for row. That computes every block of the mask, so where the extension
is longer than the prefix SGLang's way (causal, the blocks above the diagonal skipped) costs
less and is taken (`_over_prefix`). An extend without a prefix, and every case it does not cover
(encoder-decoder, cross attention, sliding windows, non-causal), runs SGLang's code unchanged.

The launcher of a `--device cpu --enable-kvtier` server sets `HOOK_ENV` for its workers
(`cpu.prepare_cpu_engine`); kvtier's plugin, loaded in every SGLang process, then installs the
hook where the variable is set (`install_if_asked`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["HOOK_ENV", "TARGET", "install", "install_if_asked", "installed", "extend_over_prefix"]

logger = logging.getLogger(__name__)

HOOK_ENV = "KVTIER_CPU_PREFIX_ATTENTION_HOOK"
FOLD_BLOCKS = 8  # blocks of a blend's folded rows (`_at_positions`)
TARGET = ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend."
          "_run_sdpa_forward_extend")
_installed: list[bool] = []


def installed() -> bool:
    """Whether this process runs extends over a cached prefix through the hook."""
    return bool(_installed)


def install() -> bool:
    """Register the hook with SGLang's plugin registry, once per process; returns whether this
    call registered it (a second call, from the demo's plugin or a test, does nothing)."""
    if _installed:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvtier.integration.sglang.blending import in_forward

    HookRegistry.register(TARGET, extend_over_prefix, HookType.AROUND)
    in_forward.install()  # a blend's recompute runs in SGLang's forward through this attention
    _installed.append(True)
    return True


def install_if_asked() -> None:
    """In a worker of a launcher that asked for it (`HOOK_ENV`), install the hook."""
    if os.environ.get(HOOK_ENV) == "1":
        install()


def extend_over_prefix(
    original: Callable[..., torch.Tensor], self: object, query: torch.Tensor,
    output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
    encoder_lens: torch.Tensor | None = None, scaling: float | None = None,
    enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
    sliding_window_size: int | None = None,
) -> torch.Tensor:
    """AROUND `TorchNativeAttnBackend._run_sdpa_forward_extend`: the same output, computed
    with the extension's queries only where a request has a cached prefix."""
    from kvtier.integration.sglang.blending.in_forward import folding

    windowed = sliding_window_size is not None and sliding_window_size > -1
    if (encoder_lens is not None or is_cross_attn or windowed or not causal
            or int(extend_prefix_lens.max()) == 0) and not folding():
        return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                        seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens,
                        scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                        is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    return _extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                   seq_lens, extend_prefix_lens, extend_seq_lens, scaling, enable_gqa)


def _extend(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
            seq_lens: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
            scaling: float | None, enable_gqa: bool) -> torch.Tensor:
    from torch.nn.functional import scaled_dot_product_attention

    from kvtier.integration.sglang.blending.in_forward import query_positions

    heads_first = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
    start = 0
    for i in range(seq_lens.shape[0]):
        n_q, prefix, n_kv = int(extend_lens[i]), int(prefix_lens[i]), int(seq_lens[i])
        q = heads_first[:, start:start + n_q, :]
        slots = req_to_token[req_pool_indices[i], :n_kv]
        k = k_cache[slots].movedim(0, query.dim() - 2).to(q.dtype)
        v = v_cache[slots].movedim(0, query.dim() - 2).to(q.dtype)
        rows = query_positions(i)  # a blend's rows folded into this extend (in_forward.py)
        if rows is not None:
            out = _at_positions(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), rows, scaling,
                                enable_gqa)
        elif prefix == 0:  # SGLang's own computation for a fresh sequence
            out = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                               enable_gqa=enable_gqa, scale=scaling,
                                               is_causal=True)
        else:
            out = _over_prefix(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), prefix, scaling,
                               enable_gqa)
        output[start:start + n_q] = out.squeeze(0).movedim(query.dim() - 2, 0)
        start += n_q
    return output


def _at_positions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                  scaling: float | None, enable_gqa: bool) -> torch.Tensor:
    """Attention of queries `q` (`[1, heads, n, dim]`) at positions `rows` (`[n]`, any
    order) over the sequence's keys `k`, `v` in position order: each sees the keys up to its
    own position (a blend's rows stand before the extend's own tokens, not after them).

    In `FOLD_BLOCKS` blocks of rows by position, each over the keys up to its last row only:
    one mask over every key computes every score, the half past each row's position too (a
    blend's ~410 rows over 2,500 keys, SmolLM2's 9 heads, one thread: 19.0 ms a layer in one
    block, 12.5 ms in 8)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    rows = rows.to(q.device)
    order = torch.argsort(rows)
    ordered = rows[order]
    n = rows.shape[0]
    out = q.new_empty(q.shape)
    step = max(1, -(-n // FOLD_BLOCKS))  # no rows: no block, an empty output
    for start in range(0, n, step):
        block, upto = order[start:start + step], ordered[start:start + step]
        end = int(upto[-1]) + 1
        mask = torch.arange(end, device=q.device).unsqueeze(0) <= upto.unsqueeze(1)
        out[..., block, :] = scaled_dot_product_attention(
            q[..., block, :], k[..., :end, :], v[..., :end, :], attn_mask=mask,
            enable_gqa=enable_gqa, scale=scaling)
    return out


def _over_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                 scaling: float | None, enable_gqa: bool) -> torch.Tensor:
    """Attention of the extension's queries `q` (`[1, heads, n, dim]`, query j at position
    `prefix + j`) over keys `k`, `v` (`[1, kv_heads, prefix + n, dim]`): every key up to
    its own position.

    Two ways, the cheaper one by the blocks computed: the extension's queries alone under a
    mask shifted by the prefix, which computes every block (`n x (prefix + n)`), or SGLang's
    way, zero queries for the prefix's rows under the causal mask, whose blocks above the
    diagonal the kernel skips (`(prefix + n)^2 / 2`). The mask wins while the prefix is the
    longer part (a long hit, a short question), SGLang's way while the extension is. Always
    masked, a 2,500-token prompt with a 256-token hit took longer than the same prompt with
    no hit (its attention 1.7x: issue 75's blends that fell back to a full prefill)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    n = q.shape[-2]
    if n >= prefix:
        padded = q.new_zeros(*q.shape[:-2], prefix + n, q.shape[-1])
        padded[..., prefix:, :] = q
        out = scaled_dot_product_attention(padded, k, v, enable_gqa=enable_gqa, scale=scaling,
                                           is_causal=True)
        return out[..., prefix:, :]
    rows = torch.arange(n, device=q.device).unsqueeze(1) + prefix
    mask = torch.arange(k.shape[-2], device=q.device).unsqueeze(0) <= rows
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa,
                                        scale=scaling)
