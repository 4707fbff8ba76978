"""Blends computed off SGLang's scheduler thread, while their requests wait in the queue.

A blend runs kvtier's own forward over a prompt (`kvtier.blend`): seconds on a CPU. Run at
admission, on the scheduler thread, it stopped every running stream for that long (2.3 s on a
quiet 2-core host, 7-17 s on a busy one). So a request that will blend waits in SGLang's
waiting queue instead, as a request waits for its load from disk (`check_prefetch_progress`),
while its blend is computed here, on a thread of its own; the scheduler goes on running the
other requests, and at the request's admission only copies the result into its slots.

The job computes the prompt from its first token: which prefix the device holds is known only
at admission (and the pool's rows may change meanwhile), so the job computes those tokens too,
as a prefill would (exact), and the admission writes the tokens past the device prefix only.
One job runs at a time (a second blend would only share the same cores); results wait for
their admission, at most `MAX_DONE` of them (the oldest go first: that request blends at its
admission on the scheduler thread, as before).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NamedTuple

import numpy as np
import torch

from kvtier.background import CpuTime
from kvtier.blend.assemble import Assembled, assemble
from kvtier.blend.forward import BlendPlan, LlamaWeights, blend, prefill
from kvtier.engine.segments import SegmentStore
from kvtier.integration.sglang.blending.blend_chains import SegmentHits
from kvtier.metrics import Counters, RateLimitedLog

__all__ = ["BlendJobs", "Computed", "MAX_DONE", "POLL_WAIT_S", "compute"]

logger = logging.getLogger(__name__)

MAX_DONE = 4  # computed blends waiting for their requests' admission
# How long the scheduler's check of a waiting request waits for its blend: a scheduler with
# nothing else to run asks again at once, thousands of times a second, and that busy loop took
# a core from the blend it waited for; a running stream's step grows by this at most.
POLL_WAIT_S = 0.002


class Computed(NamedTuple):
    """A blend of a prompt's tokens `[0, end)`: the KV of every token (`kv`, `[2, layers,
    end, kv_width]`), which tokens were loaded (`cached`) and computed although loaded
    (`must`), the segments that gave tokens, the tokens computed in the last layer, and the
    seconds it took to read and to compute (with how many threads)."""

    end: int
    kv: torch.Tensor
    cached: torch.Tensor
    must: torch.Tensor
    segments_hit: int
    computed: torch.Tensor
    read_s: float
    compute_s: float
    threads: int
    # On a tensor-parallel server (`compute(..., cols=)`): per token, how far this rank's
    # heads' loaded values at the check layer are from the fresh ones. `computed` is then
    # every token, until the ranks' sum picks the share at admission (`blend_ranks`).
    deviation: torch.Tensor | None = None
    # Every layer computed: the rows past the check layers too (`rows_forward`, before the
    # admission, on `rows_threads` threads), so SGLang's extend computes the request's own
    # tokens only.
    whole: bool = False
    rows_threads: int = 0
    # How many of the cores other processes kept busy while the check layers ran (None:
    # unknown), and when those started (`time.monotonic()`): `rows_forward` picks its threads.
    others: float | None = None
    computed_at: float = 0.0

    def tally(self, device_len: int) -> tuple[int, int, int]:
        """Of the tokens past `device_len` (what the pool held stays; what the blend wrote):
        those loaded, those of them recomputed (the share), and those that kept their
        cached KV (loaded, and not computed in the last layer: neither the share nor a
        segment's first token)."""
        new = torch.zeros_like(self.cached)
        new[device_len:] = True
        loaded = int((self.cached & new).sum())
        recomputed = int((self.cached & new & ~self.must)[self.computed].sum())
        last = torch.zeros_like(new)
        last[self.computed] = True
        return loaded, recomputed, int((self.cached & new & ~last).sum())

    def rows_where(self) -> str:
        """Where SGLang ran the rows past the check layers, for the log."""
        n = self.rows_threads
        return f"model before admission on {n} thread{'s' * (n > 1)}" if self.whole else "forward"

    def counted(self, counters: Counters, device_len: int) -> tuple[int, int, int]:
        """Count this blend in `counters` (`blender.BLEND_COUNTERS`); returns `tally`."""
        loaded, recomputed, kept = self.tally(device_len)
        counters.inc("sglang.blend_requests")
        counters.inc("sglang.blend_segments_hit", self.segments_hit)
        counters.inc("sglang.blend_tokens_loaded", loaded)
        counters.inc("sglang.blend_tokens_recomputed", recomputed)
        return loaded, recomputed, kept


Compute = Callable[[np.ndarray, SegmentHits, str], "Computed | None"]
Pool = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]  # per-layer K and V buffers


@torch.inference_mode()
def compute(w: LlamaWeights, store: SegmentStore, plan: BlendPlan, pool: Pool,
            tokens: np.ndarray, hits: SegmentHits, salt: str,
            prefix: tuple[int, torch.Tensor] | None = None,
            upto: int | None = None, cols: slice | None = None) -> Computed | None:
    """Blend tokens `[0, hits.end)` from the held segments of `hits` (read from `store`)
    with plan `plan` over weights `w`; with `upto`, only up to that layer (the rest is
    SGLang's forward's: `in_forward`). With `prefix` (the device prefix's length and pool
    slots: at admission) the device prefix's KV is read from `pool`, else computed. None
    when no held segment could be read any more. Thread-safe (a blend job runs it).

    With `cols` (a tensor-parallel server: `w` is the whole model, the segments and the pool
    hold this rank's columns of it), the check layer (one, `upto`) is computed for every token
    and the result holds this rank's columns and its `deviation` (`blend_ranks`)."""
    start = time.perf_counter()
    end, dev = hits.end, w.embed.device
    ids = torch.from_numpy(np.ascontiguousarray(tokens[:end])).to(dev)
    width = w.kv_width if cols is None else cols.stop - cols.start
    known = assemble(store, w.rope, tokens[:end].tolist(), hits.held,
                     num_layers=w.num_layers, num_kv_heads=width // w.head_dim,
                     head_dim=w.head_dim, dtype=w.embed.dtype, device=dev, salt=salt,
                     chains=hits.chains or None)
    if not known.segments_hit:
        return None
    # Rows no segment gave are computed only up to `upto` here, the rest by SGLang's extend
    # (in_forward): finite until then, never the buffer's leftovers.
    known.kv[:, :, ~known.cached] = 0
    if cols is not None:
        assert upto is not None
        return _check_columns(w, ids, known, upto, cols, start)
    cached = known.cached.clone()
    if prefix is not None:
        device_len, rows = prefix[0], prefix[1].to(dev, torch.int64)
        for layer in range(w.num_layers):
            known.kv[0, layer, :device_len] = pool[0][layer][rows].view(device_len, -1)
            known.kv[1, layer, :device_len] = pool[1][layer][rows].view(device_len, -1)
        cached[:device_len] = True
    # the host's load, for the rows' threads (`rows_forward`: SGLang's CPU engine only)
    cpu = CpuTime.now() if dev.type == "cpu" else None
    loaded_at, began = time.perf_counter(), time.monotonic()
    with _compute_threads(dev) as threads:
        out = blend(w, ids, known.kv, cached, plan, must=known.must, logits=False, upto=upto,
                    in_place=True)  # known.kv is this job's own
    if dev.type == "cuda":  # the result may be read on another thread's stream
        torch.cuda.current_stream(dev).synchronize()
    after = CpuTime.now() if cpu else None
    return Computed(end, out.kv, known.cached, known.must, known.segments_hit, out.computed,
                    loaded_at - start, time.perf_counter() - loaded_at, threads,
                    others=after.others_since(cpu) if cpu and after else None,
                    computed_at=began)


def _check_columns(w: LlamaWeights, ids: torch.Tensor, known: Assembled, layer: int,
                   cols: slice, start: float) -> Computed:
    """`compute` on a tensor-parallel rank: every token through the check `layer`, this
    rank's columns of it written over the loaded KV, and the deviation of its loaded values
    there."""
    loaded_at = time.perf_counter()
    with _compute_threads(ids.device) as threads:
        fresh = prefill(w, ids, logits=False, upto=layer).kv
    deviation = (fresh[1, layer][:, cols].float() - known.kv[1, layer].float()).pow(2).sum(-1)
    known.kv[:, :layer + 1] = fresh[:, :layer + 1, :, cols]
    if ids.device.type == "cuda":
        torch.cuda.current_stream(ids.device).synchronize()
    every = torch.arange(len(ids), device=ids.device)
    return Computed(len(ids), known.kv, known.cached, known.must, known.segments_hit, every,
                    loaded_at - start, time.perf_counter() - loaded_at, threads, deviation)


@contextlib.contextmanager
def _compute_threads(device: torch.device) -> Iterator[int]:
    """On a CPU, every core this process may use for the blend's forward, on the calling
    thread: SGLang's scheduler thread runs with one (its forward passes run on another
    thread), which made a blend take three times as long as the same forward offline."""
    before = torch.get_num_threads()
    if device.type != "cpu":
        yield before
        return
    threads = max(before, len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


class BlendJobs:
    """The jobs of one blender. `start`, `running` and `take` are called on the scheduler
    thread; `compute(tokens, hits, salt)` runs on the job thread (None: nothing to blend)."""

    def __init__(self, compute: Compute, counters: Counters) -> None:
        self._compute = compute
        self._counters = counters
        self._jobs: OrderedDict[str, Future[Computed | None]] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-blend")
        self._warn = RateLimitedLog(logger)

    def start(self, rid: str, tokens: np.ndarray, hits: SegmentHits, salt: str) -> None:
        """Compute request `rid`'s blend of `hits` (looked up with no device prefix)."""
        self.drop(rid)
        while len(self._jobs) >= MAX_DONE:
            oldest = next(iter(self._jobs))
            self.drop(oldest)
        self._jobs[rid] = self._pool.submit(self._compute, tokens, hits, salt)

    def __contains__(self, rid: str) -> bool:
        return rid in self._jobs

    def running(self, rid: str, wait_s: float = 0.0) -> bool:
        """Whether request `rid`'s blend is still being computed (it waits in the queue),
        after waiting up to `wait_s` for it to end."""
        job = self._jobs.get(rid)
        if job is None:
            return False
        if wait_s > 0:
            wait([job], timeout=wait_s)
        return not job.done()

    def take(self, rid: str, end: int) -> Computed | None:
        """Request `rid`'s computed blend of tokens `[0, end)`, once; None if there is none
        (never started, dropped, still running, failed, or of another length)."""
        job = self._jobs.get(rid)
        if job is None or not job.done():
            return None
        del self._jobs[rid]
        try:
            done = job.result()
        except Exception as exc:  # a cache never takes serving down: the request is computed
            self._counters.inc("sglang.blend_failures")
            self._warn.warning("job", "kvtier: blending %s off the scheduler thread failed; "
                               "computing it instead: %r", rid, exc)
            return None
        return done if done is not None and done.end == end else None

    def drop(self, rid: str) -> None:
        """Forget request `rid`'s job (a job not started yet never runs)."""
        job = self._jobs.pop(rid, None)
        if job is not None:
            job.cancel()

    def clear(self) -> None:
        for rid in list(self._jobs):
            self.drop(rid)

    def close(self) -> None:
        self.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
