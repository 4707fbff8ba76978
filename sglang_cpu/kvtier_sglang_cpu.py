"""SGLang plugin (entry point `kvtier_cpu_fixes`): prefix hits that save work on CPU.

SGLang 0.5.23's `torch_native` attention backend (the one that runs on CPU) computes an extend
over a cached prefix as if the whole sequence were new: it builds a query tensor as long as
prefix + extension and runs causal attention over all of it, then keeps the extension's rows.
A request whose 4K-token prefix is cached therefore still pays a 4K x 4K attention per layer
(measured: a 4096-token prefix hit cost 1.04 s against 2.47 s for no hit), which hides what any
prefix cache, SGLang's own radix tree included, saves.

This plugin runs such extends with the extension's queries only, against the prefix's and the
extension's keys, under the causal mask shifted by the prefix length. Extends without a prefix
(and every case the fast path does not cover: encoder-decoder, sliding windows, non-causal)
take SGLang's own code unchanged. Loaded by every SGLang process that has this directory on its
PYTHONPATH; never part of the kvtier package.

With `KVTIER_BENCH_FORWARD_LOG=PATH` (benchmarks only) it also appends one line per model
forward to PATH: its end (wall clock), extend or decode, its tokens, its wall seconds and the
seconds the calling thread ran on a core meanwhile. A forward whose wall time exceeds its CPU
time waited for a core another thread or process held; the same CPU time for the same tokens
on two servers means they compute alike.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, TextIO

_TARGET = ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend."
           "_run_sdpa_forward_extend")


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET, _extend_without_redundant_queries, HookType.AROUND)
    if os.environ.get(_FORWARD_LOG):
        HookRegistry.register(_FORWARD, _timed_forward, HookType.AROUND)


_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
_FORWARD_LOG = "KVTIER_BENCH_FORWARD_LOG"
_log: list[TextIO] = []
_log_lock = threading.Lock()


def _timed_forward(original: Any, self: Any, forward_batch: Any, *args: Any,
                   **kwargs: Any) -> Any:
    wall, cpu = time.perf_counter(), time.thread_time()
    try:
        return original(self, forward_batch, *args, **kwargs)
    finally:
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        extend = forward_batch.forward_mode.is_extend()
        tokens = (int(getattr(forward_batch, "extend_num_tokens", 0) or 0) if extend
                  else int(forward_batch.batch_size))
        with _log_lock:
            if not _log:
                _log.append(open(os.environ[_FORWARD_LOG], "a", buffering=1))  # noqa: SIM115
            _log[0].write(f"{time.time():.3f} {'extend' if extend else 'decode'} {tokens} "
                          f"{wall:.6f} {cpu:.6f}\n")


def _extend_without_redundant_queries(
    original: Any, self: Any, query: Any, output: Any, k_cache: Any, v_cache: Any,
    req_to_token: Any, req_pool_indices: Any, seq_lens: Any, extend_prefix_lens: Any,
    extend_seq_lens: Any, encoder_lens: Any = None, scaling: Any = None,
    enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
    sliding_window_size: Any = None,
) -> Any:
    windowed = sliding_window_size is not None and sliding_window_size > -1
    if (encoder_lens is not None or is_cross_attn or windowed or not causal
            or int(extend_prefix_lens.max()) == 0):
        return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                        seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens,
                        scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                        is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    heads_first = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
    start_q = 0
    for i in range(seq_lens.shape[0]):
        n_q, prefix, n_kv = (int(extend_seq_lens[i]), int(extend_prefix_lens[i]),
                             int(seq_lens[i]))
        q = heads_first[:, start_q:start_q + n_q, :]
        slots = req_to_token[req_pool_indices[i], :n_kv]
        k = k_cache[slots].movedim(0, query.dim() - 2).to(q.dtype)
        v = v_cache[slots].movedim(0, query.dim() - 2).to(q.dtype)
        if prefix == 0:
            mask, is_causal = None, True  # SGLang's own computation for a fresh sequence
        else:
            # Query j sits at position prefix + j and sees keys 0 .. prefix + j.
            rows = torch.arange(n_q, device=q.device).unsqueeze(1) + prefix
            mask, is_causal = torch.arange(n_kv, device=q.device).unsqueeze(0) <= rows, False
        out = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask, enable_gqa=enable_gqa,
                                           scale=scaling, is_causal=is_causal)
        output[start_q:start_q + n_q] = out.squeeze(0).movedim(query.dim() - 2, 0)
        start_q += n_q
    return output
