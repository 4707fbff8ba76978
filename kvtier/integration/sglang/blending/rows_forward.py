"""A blend's recomputed rows through SGLang's own model, on kvtier's blend thread (issue 75).

Folded into the request's extend (`in_forward`), the rows a blend recomputes past its check
layers cost one prefill step of about a second for a 2,500-token SmolLM2 prompt on a 2-core
host, and every running stream waits for that step: its worst inter-token gap was 20x its
median. Here the same rows run through the same model code, weights and attention before the
request is admitted, on the blend job's thread, while the scheduler goes on stepping the
running streams; at admission only the finished KV is copied into the request's slots and
its extend computes its own tokens.

The forward sees a batch of one request whose KV pool is the blend's own assembled KV
(`_BlendPool`, a view of `[2, layers, tokens, width]`: slot i holds token i), so the rows'
fresh KV lands there layer by layer, and whose attention is a copy of the server's backend
over that pool. Each row attends to the keys up to its own position (`in_forward`'s fold
attention, asked through this thread's `query_positions`). SGLang keeps the forward's
context (`get_forward_context`, the attention backend its layers call) in one module-level
variable, safe while every forward runs on one thread; `install` lets a thread that set an
override read its own (`_ThreadContext`), every other thread SGLang's, unchanged.

The rows run on the job thread, on every core only when the host was quiet while the check
layers ran (`rows_threads`: no batch of SGLang's ran, and other processes kept less than
`QUIET_CORES` of the cores busy), else on one thread, as SGLang's CPU workers start. The
rows' forward is many small parallel regions: beside a busy process a team of two waited at
each barrier for the core that process held (a blend took 14.6 s against 2.5 s quiet; with one
thread 0.77x the full prefill's TTFT there), while on a quiet host two threads took 0.44x
against one thread's 0.50x.

The same forward computes a segment alone for the blender's segment worker (`alone`): its
records, and the check of them, are then SGLang's own KV, not kvtier's second implementation's.

Only at tensor parallel 1: a forward at TP > 1 runs collectives, which must be called by
every rank in the same order as the scheduler's (`blend_ranks` folds there).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from copy import copy
from typing import Any

import numpy as np
import torch

from kvtier.background import ENGINE
from kvtier.integration.sglang.blending import in_forward
from kvtier.integration.sglang.blending.blend_jobs import Computed
from kvtier.integration.sglang.boundary.sglang_views import Opaque

__all__ = ["QUIET_CORES", "RowsForward", "install", "rows_threads"]

logger = logging.getLogger(__name__)

# Other processes' use of the cores, while a blend's check layers ran, under which the host
# counts as quiet: a busy process beside the server measures about 1 core on 2, an idle host
# about 0.01.
QUIET_CORES = 0.25


class _ThreadContext(threading.local):
    ctx: Any = None  # this thread's forward context, over SGLang's module-level one


_local = _ThreadContext()
_installed: list[Callable[[], Any]] = []


def install() -> None:
    """Make SGLang's `get_forward_context` answer a thread's own override when it set one
    (once per process; the scheduler's thread never sets one and reads SGLang's, as before)."""
    if _installed:
        return
    from sglang.srt.model_executor import forward_context as fc

    original = fc.get_forward_context

    def get_forward_context() -> Any:
        own = _local.ctx
        return own if own is not None else original()

    fc.get_forward_context = get_forward_context
    _installed.append(original)


class _BlendPool:
    """The blend's KV `[2, layers, tokens, width]` as SGLang's attention reads and writes a
    pool: token i in slot i, each layer's keys and values `[tokens, heads, head_dim]` views."""

    def __init__(self, kv: torch.Tensor, heads: int, head_dim: int) -> None:
        self.kv = kv
        self.shape = (kv.shape[2], heads, head_dim)
        self.dtype = kv.dtype

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv[0, layer_id].view(self.shape)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv[1, layer_id].view(self.shape)

    def set_kv_buffer(self, layer: Opaque, loc: Opaque, cache_k: torch.Tensor,
                      cache_v: torch.Tensor, *args: object, **kwargs: object) -> None:
        slots = getattr(loc, "loc", loc)
        layer_id = layer.layer_id
        self.get_key_buffer(layer_id)[slots] = cache_k.view(-1, *self.shape[1:]).to(self.dtype)
        self.get_value_buffer(layer_id)[slots] = cache_v.view(-1, *self.shape[1:]).to(self.dtype)


class _Tokens:
    """SGLang's `req_to_token_pool` for one request whose token i sits in slot i."""

    def __init__(self, tokens: int) -> None:
        self.req_to_token = torch.arange(tokens, dtype=torch.int32).unsqueeze(0)


class RowsForward:
    """SGLang's model over chosen rows of a blend, on the calling thread (see the module doc).
    Built on the scheduler thread from its model runner. `run` and `alone` may run on several
    threads at once (the blend job's, the segment worker's): each call has its own pool,
    backend copy and context, and the model's modules hold no state across a forward."""

    def __init__(self, model_runner: Opaque) -> None:
        install()
        self.model = model_runner.model.model  # the decoder stack: hidden states, no logits
        self.backend = model_runner.attn_backend
        pool = model_runner.token_to_kv_pool
        self.heads, self.head_dim = pool.k_buffer[0].shape[1:]
        self.layers, self.dtype = len(pool.k_buffer), pool.k_buffer[0].dtype
        self.broken = False  # `run` failed once: the rows fold into the extend (`finish`)

    @torch.inference_mode()
    def run(self, kv: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Compute tokens `rows` (int64 positions, sorted) of the prompt `ids` in every layer,
        each attending to the tokens up to its own position in `kv` (`[2, layers, len(ids),
        width]`), and write their fresh KV into `kv`."""
        if len(rows):
            with in_forward.rows_at(rows):
                self._forward(kv, ids, rows)

    @torch.inference_mode()
    def alone(self, ids: torch.Tensor) -> torch.Tensor:
        """The KV (`[2, layers, len(ids), width]`) of tokens `ids` computed alone from position
        0 by SGLang's model and its own attention, as its prefill of a prompt that starts with
        them computes it: what a segment record holds (`blend_worker`)."""
        n = len(ids)
        kv = torch.zeros(2, self.layers, n, self.heads * self.head_dim, dtype=self.dtype)
        if n:
            self._forward(kv, ids.to(torch.int64), torch.arange(n))
        return kv

    def _forward(self, kv: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """SGLang's decoder stack over tokens `rows` of `ids` as one request's extend, its
        pool `kv` (the tokens before `rows` are its cached prefix), on this thread."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext

        n, end = len(rows), len(ids)
        pool, tokens = _BlendPool(kv, self.heads, self.head_dim), _Tokens(end)
        backend = copy(self.backend)
        backend.token_to_kv_pool, backend.req_to_token_pool = pool, tokens
        backend.swa_out_cache_loc = None
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=ids[rows],
            req_pool_indices=torch.zeros(1, dtype=torch.int64),
            seq_lens=torch.tensor([end]), out_cache_loc=rows, seq_lens_sum=end,
            seq_lens_cpu=torch.tensor([end]), positions=rows,
            extend_num_tokens=n, extend_seq_lens=torch.tensor([n]),
            extend_prefix_lens=torch.tensor([end - n]), extend_seq_lens_cpu=[n],
            extend_prefix_lens_cpu=[end - n], extend_start_loc=torch.zeros(1, dtype=torch.int64))
        _local.ctx = ForwardContext(attn_backend=backend)
        try:
            self.model(batch.input_ids, rows, batch)
        finally:
            _local.ctx = None

    def finish(self, done: Computed, tokens: np.ndarray) -> Computed:
        """`done` (computed up to its check layers) with its rows past them computed here
        (`run`), in every layer: its admission folds nothing. Should SGLang's model refuse to
        run this way (another SGLang version), `done` is returned as it came, the rows left to
        the admission's fold (exact: the fold writes each row in every layer), and every later
        blend folds too (logged once)."""
        if self.broken:
            return done
        start = time.perf_counter()
        ids = torch.from_numpy(np.ascontiguousarray(tokens[:done.end])).to(torch.int64)
        rows = torch.sort(done.computed.cpu().to(torch.int64)).values
        threads, before = rows_threads(done), torch.get_num_threads()
        torch.set_num_threads(threads)  # this thread's own team (see the module doc)
        try:
            self.run(done.kv, ids, rows)
        except Exception:
            self.broken = True
            logger.exception("kvtier: SGLang's model did not compute a blend's rows before "
                             "admission; blends fold them into their extend from now on")
            return done
        finally:
            torch.set_num_threads(before)
        return done._replace(whole=True, compute_s=done.compute_s + time.perf_counter() - start,
                             rows_threads=threads)


def rows_threads(done: Computed) -> int:
    """Threads for `done`'s rows: every core this process may use if the host was quiet while
    its check layers ran (no batch of SGLang's ran since they began, and other processes kept
    less than `QUIET_CORES` of the cores busy), else one (see the module doc)."""
    quiet = (done.others is not None and done.others < QUIET_CORES
             and not ENGINE.ran_since(done.computed_at))
    return len(os.sched_getaffinity(0)) if quiet else 1
