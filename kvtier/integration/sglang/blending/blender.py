"""Blended prefill on SGLang (`enable_blending`): reuse of segments at any position.

At a request's match (`KVTierRadixCache.match_prefix`) the blender finds its segments (runs
ended by `blend_special_str`) past the device prefix and asks the CPU tier which it holds
(metadata only). When they hold more tokens than a prefix load would give, and a blend is
measured to beat the full prefill (`kvtier.blend.planner`), the match promises them as a host
hit. The blend itself, the prompt but its last token computed over that KV (`kvtier.blend`:
segments re-rotated to where they stand, a share of the cached tokens recomputed from the
check layers on) with the served model's own weights, runs while the request waits in the
queue, off the scheduler thread (`blend_jobs`); at admission (`init_load_back`) the result is
copied into the slots the tree inserts. A request that reaches admission without one (no
prefetch hook ran) is blended there, the device prefix read from the pool. SGLang then
computes the last token and decodes as usual.

Blended KV is an approximation, so it never becomes a prefix record: its slots are marked
(`BlendedSlots`) and a store stops at the first marked slot. It stays in SGLang's device tree
like computed KV until evicted (a later request of the same prefix on this server reuses it).

Segments a request missed are computed alone (position 0) on a background thread, while a CPU
engine is quiet (`background.ENGINE`), and put in the tiers for the next prompt that holds them;
a request that verification samples has its segments' records compared with them computed
alone again there (`blend_worker.SegmentWorker`).

Every TP rank blends the same tokens and recomputes the same rows (`blend_ranks`). What cannot
blend is refused at launch by name (`blend_setup`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from kvtier.blend.forward import BlendPlan, LlamaWeights
from kvtier.blend.planner import BlendPlanner
from kvtier.blend.segments import Segment
from kvtier.config.schema import BlendSection
from kvtier.engine.segments import SegmentStore
from kvtier.errors import ConfigError
from kvtier.integration.sglang.blending import in_forward
from kvtier.integration.sglang.blending.blend_chains import (
    SegmentChains,
    SegmentHits,
    hint_preamble,
)
from kvtier.integration.sglang.blending.blend_jobs import POLL_WAIT_S, BlendJobs, Computed, compute
from kvtier.integration.sglang.blending.blend_ranks import Ranks, agreed_rows, rows_to_come
from kvtier.integration.sglang.blending.blend_state import BlendRequest, blend_requests
from kvtier.integration.sglang.blending.blend_worker import WORKER_COUNTERS, SegmentWorker
from kvtier.integration.sglang.blending.blended_slots import BlendedSlots
from kvtier.integration.sglang.blending.rows_forward import RowsForward
from kvtier.keys import KeyChain
from kvtier.metrics import Counters

__all__ = ["BLEND_COUNTERS", "BlendedSlots", "SGLangBlender", "SegmentHits"]

logger = logging.getLogger(__name__)

BLEND_COUNTERS = ("blend_requests", "blend_segments_hit", "blend_tokens_loaded",
                  "blend_tokens_recomputed", *WORKER_COUNTERS, "blend_segments_capped",
                  "blend_failures", "blend_fallbacks_slower", "blend_probes",
                  "blend_fold_mismatches")

class SGLangBlender:
    """Blends for one scheduler (one TP rank). Built by `blend_setup.blender_for` after SGLang
    loaded the model.

    Args:
        weights: the served model's tensors (`blend_model.served_weights`).
        store: the segment store in the engine's tiers (`CacheEngine.segments`).
        section: the config's blending keys.
        separator: `blend_special_str` as token ids.
        pool: the KV pool's per-layer K and V buffers (`[slots, kv_heads, head_dim]`).
        page_size: SGLang's page size (a blend ends on a page boundary).
        counters: where `BLEND_COUNTERS` are counted (the adapter's).
        prefill_s: `(tokens, prompt_len) -> seconds` SGLang is expected to take to prefill
            them (`CacheEngine.prefill.recompute_s`); None: a blend is always worth it.
        in_forward: SGLang's forward computes the tokens past the check layers (`in_forward`);
            else kvtier's forward computes every layer.
        ranks: on a tensor-parallel server, this rank and its group (`blend_ranks`; then
            `weights` are the whole model's, `pool` this rank's heads, and `in_forward` holds).
        rows: at TP 1, with `in_forward`: SGLang's model computes those tokens in the blend's
            job, before admission (`rows_forward`), instead of in the request's extend, and
            the segments alone (`SegmentWorker`).
    """

    def __init__(self, weights: LlamaWeights, store: SegmentStore, section: BlendSection,
                 separator: Sequence[int], pool: tuple[Sequence[torch.Tensor],
                                                       Sequence[torch.Tensor]],
                 page_size: int, counters: Counters,
                 prefill_s: Callable[[int, int], float] | None = None, in_forward: bool = False,
                 ranks: Ranks | None = None, rows: RowsForward | None = None):
        last = max(section.check_layers)
        if last >= weights.num_layers:
            raise ConfigError(f"blend_check_layers: {list(section.check_layers)} reaches past "
                              f"the model's {weights.num_layers} layers")
        self.w = weights
        self.store = store
        self.section = section
        self.plan = BlendPlan(section.check_layers, section.ratios)
        self.separator = tuple(separator)
        self.pool_k, self._v = pool
        self.ranks = ranks
        heads = self.pool_k[0].shape[1]  # this rank's
        self.cols = None if ranks is None else ranks.columns(heads * weights.head_dim)
        self.page_size = page_size
        self.counters = counters
        self.chains = SegmentChains(store, self.separator, section.min_tokens, counters)
        self.worker = SegmentWorker(weights, store, self.separator, section.min_tokens,
                                    self.chains.max_segments, counters, self.cols, rows)
        self.requests = blend_requests()  # request id -> its BlendRequest
        self.planner = BlendPlanner(section.max_prefill_ratio)
        self._prefill_s = prefill_s
        self.in_forward = in_forward
        self.rows = rows  # computes the rows past the check layers in a blend's job
        self.jobs = BlendJobs(self._compute, counters)  # blends off the scheduler thread
        self._hinted = False  # the preamble hint (`hint_preamble`) was logged
        self._asks = ThreadPoolExecutor(1, thread_name_prefix="kvtier-blend-ask")  # `prefetch`

    # ---- admission (scheduler thread) ----

    def look(self, rid: str, tokens: np.ndarray, device_len: int, salt: str,
             prompt_len: int | None = None) -> SegmentHits:
        """`tokens`' segments past `device_len` and what the CPU tier holds of them
        (remembered for request `rid`'s `finished`), for a prompt of `prompt_len` tokens
        (default: `tokens` are all of it). The segments and their keys are found once per
        request (`chains`); the CPU tier is asked at every call."""
        # SGLang computes the last prompt token itself
        n = (len(tokens) if prompt_len is None else prompt_len) - 1
        end = n - n % self.page_size
        held: list[Segment] = []
        chains: list[KeyChain] = []
        missed: list[Segment] = []
        cached = 0
        prompt = self.chains.of(rid, tokens, salt)
        looked = []
        for seg, chain in zip(prompt.segments, prompt.chains):
            if seg.end + len(self.separator) > end:
                break  # its separator is not computed by the blend: the rest are not either
            if seg.end > device_len:  # else in the pool already, exact
                looked.append((seg, chain))
        gots = [self.store.lookup(chain, hot_only=True) for _, chain in looked]
        if self.ranks is not None:  # what every rank's CPU tier holds
            gots = self.ranks.least(gots)
        for (seg, chain), got in zip(looked, gots):
            (held if got else missed).append(seg)
            if got:
                chains.append(chain)
            if got < seg.num_tokens and got:
                missed.append(seg)  # its tail was evicted: computed again, stored again
            # What the pool holds of it stays (exact); the rest is what the segment adds.
            cached += max(0, seg.start + got - max(seg.start, device_len))
        hits = SegmentHits(end, tuple(held), tuple(missed), cached, tuple(chains), device_len)
        if held and not self._hinted and prompt.segments:
            self._hinted = hint_preamble(rid, prompt.segments[0], hits, device_len,
                                         self.section.separator)
        self.requests.open(rid).hits = hits
        return hits

    def worth(self, rid: str, end: int, device_len: int) -> bool:
        """Whether request `rid` should blend tokens `[device_len, end)` rather than have
        SGLang compute them: decided once (at its first match that finds held segments, or
        its prefetch: before any of them is read) and kept, as SGLang matches a waiting
        request again; a fallback is counted once, and logged."""
        request = self.requests.open(rid)
        choice = request.choice
        if choice is None:
            tokens = end - device_len
            choice = self.planner.choose(tokens, self._prefill(end, device_len))
            if self.ranks is not None and self.ranks.agree(choice.blend) != choice.blend:
                choice = choice._replace(blend=False, reason="slower on another rank")
            request.choice = choice
            if choice.reason == "probe":
                self.counters.inc("sglang.blend_probes")
            if not choice.blend:
                self.counters.inc("sglang.blend_fallbacks_slower")
                took = "unmeasured here" if choice.blend_s is None else f"{choice.blend_s:.2f}s"
                logger.info("kvtier: %s computed, not blended: a blend of %d tokens would take "
                            "%s, the full prefill %.2fs (blend_max_prefill_ratio %g; %s)", rid,
                            tokens, took, choice.prefill_s, self.planner.max_ratio, choice.reason)
        return choice.blend

    def decline(self, rid: str) -> None:
        """Request `rid` may not blend (opted out), as its match found: its prefetch loads
        no segment and starts no blend (SGLang's prefetch hook sees no request's options)."""
        request = self.requests.open(rid)
        request.declined = True
        request.waiting = None
        self.jobs.drop(rid)

    def prefetch(self, rid: str, tokens: np.ndarray, salt: str) -> None:
        """Request `rid` joined the waiting queue: start loading its segments that only disk
        or Redis hold into the CPU tier, where its match looks for them, and once they are
        in, its blend (`prefetch_ready`). While blends lose, it is chosen before any segment
        is read, once the lower tiers answered (off the scheduler thread; it waits in the
        queue for that as for a load) whether they hold one: computed, it reads none."""
        request = self.requests.open(rid)
        if request.declined or (request.choice is not None and not request.choice.blend):
            return  # computed: no segment read, no blend job, no wait
        request.waiting = (tokens, salt)  # its blend starts once its loads are in
        end, device = self._span(tokens, request)
        chains = self.chains.of(rid, tokens, salt).chains
        if self.ranks is None and request.choice is None \
                and not (request.hits is not None and request.hits.held) \
                and self.planner.loses(end - device, self._prefill(end, device)):
            if any(self.store.lookup(chain, hot_only=True) for chain in chains):
                self._chosen(rid, request, held=True)
            else:
                request.asked = self._asks.submit(
                    lambda: any(self.store.lookup(chain) for chain in chains))
        else:
            self._start_loads(request, chains)

    def _start_loads(self, request: BlendRequest, chains: Sequence[KeyChain]) -> None:
        loads = [load for chain in chains if (load := self.store.start_prefetch(chain))]
        if loads or self.ranks is not None:  # every rank waits at the same steps
            request.loads = loads

    def _span(self, tokens: np.ndarray, request: BlendRequest) -> tuple[int, int]:
        """(End, start) of what a blend of prompt `tokens` would write: whole pages, past
        the device prefix its match found."""
        n = len(tokens)
        return n - n % self.page_size, 0 if request.hits is None else request.hits.device_len

    def _chosen(self, rid: str, request: BlendRequest, held: bool) -> bool:
        """Whether waiting request `rid` (some tier `held` a segment of it) is computed now,
        by the planner's choice; else its segment loads start."""
        assert request.waiting is not None
        tokens, salt = request.waiting
        if held and not self.worth(rid, *self._span(tokens, request)):
            request.waiting = None
            return True
        self._start_loads(request, self.chains.of(rid, tokens, salt).chains)
        return False

    def _prefill(self, end: int, device_len: int) -> float:
        """The seconds SGLang is expected to take to compute tokens `[device_len, end)`."""
        return math.inf if self._prefill_s is None else self._prefill_s(end - device_len, end)

    def prefetch_ready(self, rid: str) -> bool:
        """Whether request `rid` may be admitted: its segment loads are done (per
        `prefetch_policy`; they stop then, what arrived stays in the CPU tier), and its blend,
        started then if it is worth it, has been computed (`blend_jobs`)."""
        request = self.requests.get(rid)
        if request is not None and (asked := request.asked) is not None:
            if not asked.done():
                wait([asked], timeout=POLL_WAIT_S)
            if not asked.done():
                return False
            request.asked = None  # a tier that failed to answer holds nothing (a miss)
            held = not asked.cancelled() and asked.exception() is None and asked.result()
            if request.waiting is not None and self._chosen(rid, request, held):
                return True
        if request is not None and request.loads is not None:
            ready = all(load.ready() for load in request.loads)
            if not (ready if self.ranks is None else self.ranks.agree(ready)):
                return False
            for load in request.loads:
                load.cancel()
            request.loads = None
        waiting = None if request is None else request.waiting
        if request is not None and waiting is not None:
            request.waiting = None
            tokens, salt = waiting
            # The device prefix as the request's last match found it (SGLang matches before
            # this hook): a prompt the device holds blends nothing. The hook saw the prompt
            # less its last token (SGLang's longest prefix).
            seen = request.hits
            device = 0 if seen is None else seen.device_len
            hits = self.look(rid, tokens, device, salt, prompt_len=len(tokens) + 1)
            if hits.held and self.worth(rid, hits.end, device):
                self.jobs.start(rid, tokens, hits, salt)
        done = not self.jobs.running(rid, POLL_WAIT_S)
        return done if self.ranks is None else self.ranks.agree(done)

    def cancel_prefetch(self, rid: str) -> None:
        """Request `rid` went away before admission: stop its segment loads and its blend."""
        request = self.requests.get(rid)
        if request is not None:
            for load in request.loads or []:
                load.cancel(drop=True)
            if request.asked is not None:
                request.asked.cancel()
            request.loads = request.asked = None
            request.waiting = None
        self.jobs.drop(rid)

    def finished(self, rid: str, tokens: np.ndarray, salt: str, aborted: bool,
                 verified: bool = False) -> None:
        """Request `rid` (prompt `tokens`) finished: queue the segments it missed for a
        standalone prefill and, when verification sampled it (`verified`), the records of its
        segments for a comparison with them computed alone (`SegmentWorker`)."""
        request = self.requests.get(rid)
        hits = None if request is None else request.hits
        self.forget(rid)
        if aborted:
            return
        if hits is not None and hits.missed:
            self.worker.warm(tokens, hits.missed, salt)
        if verified:
            self.worker.verify(tokens, salt)

    def forget(self, rid: str | None = None) -> None:
        """Drop what was remembered of request `rid` (call `cancel_prefetch` first if it may
        still be loading), or, when None, every request's segments, choices and blends."""
        self.chains.forget(rid)
        if rid is None:  # SGLang emptied its pool: what waits for admission still loads
            for request in self.requests:
                request.hits, request.choice, request.declined = None, None, False
            self.jobs.clear()
            in_forward.drop()
        else:
            self.requests.forget(rid)
            self.jobs.drop(rid)
            in_forward.drop(rid)

    @torch.inference_mode()
    def fill(self, rid: str, tokens: np.ndarray, hits: SegmentHits, device_len: int,
             prefix_slots: torch.Tensor, slots: torch.Tensor, salt: str) -> int | None:
        """Write tokens `[device_len, hits.end)` blended into `slots`: the request's blend
        computed off this thread (`blend_jobs`) if there is one, else computed here.

        Returns:
            How many of them kept their cached KV past the check layers (loaded and not
            recomputed: what SGLang may count as `cached_tokens`; every other one was
            computed), or None (nothing written) when no held segment could be read any more.
        """
        done, where = self.jobs.take(rid, hits.end), "off the scheduler thread"
        if self.ranks is not None:  # the same rows on every rank, or none blends
            done = agreed_rows(done, self.ranks, self.plan)
        elif done is None:
            prefix = (device_len, prefix_slots) if device_len else None
            done, where = self._compute(tokens, hits, salt, prefix), "on the scheduler thread"
        if done is None:
            self.counters.inc("sglang.blend_failures")
            return None
        end = hits.end
        try:
            self._write(done, device_len, end, slots)
        except Exception:
            if self.ranks is None:
                raise  # the tree computes the request (`_blend_into`)
            logger.exception("kvtier: writing %s's blend failed on this rank", rid)
            done = None
        if self.ranks is not None and not self.ranks.agree(done is not None):
            self.counters.inc("sglang.blend_failures")  # every rank computes it
            return None
        assert done is not None
        loaded, recomputed, kept = done.counted(self.counters, device_len)
        rows = done.computed[done.computed >= device_len].cpu()
        if self.in_forward and not done.whole:  # SGLang computes them in the extend
            in_forward.add(rid, in_forward.Splice(end, rows, self.counters))
        logger.info("kvtier: blended %s: %d tokens from %d segments at new positions, %d of them "
                    "recomputed from layer %d, %d computed (device prefix %d); cached_tokens "
                    "%d (the device prefix and the %d kept from the cache); read %.2fs, "
                    "computed %.2fs%s (%d threads, %s)", rid, loaded, done.segments_hit,
                    recomputed, self.plan.check_layers[0], end - device_len - loaded,
                    device_len, device_len + kept, kept, done.read_s, done.compute_s,
                    f" up to layer {max(self.plan.check_layers)}, {len(rows)} tokens past it "
                    f"in SGLang's {done.rows_where()}"
                    if self.in_forward else "", done.threads, where)
        return kept

    def _write(self, done: Computed, device_len: int, end: int, slots: torch.Tensor) -> None:
        """Tokens `[device_len, end)` of `done` into pool `slots`."""
        dst = slots.to(self.pool_k[0].device, torch.int64)
        shape = (end - device_len, *self.pool_k[0].shape[1:])
        for layer in range(self.w.num_layers):
            self.pool_k[layer][dst] = done.kv[0, layer, device_len:end].reshape(shape)
            self._v[layer][dst] = done.kv[1, layer, device_len:end].reshape(shape)
        if dst.device.type == "cuda":  # SGLang's forward reads the slots on a stream of its own
            torch.cuda.current_stream(dst.device).synchronize()

    def _compute(self, tokens: np.ndarray, hits: SegmentHits, salt: str,
                 prefix: tuple[int, torch.Tensor] | None = None) -> Computed | None:
        """`blend_jobs.compute` over this blender's model, segments and pool, timed for the
        planner. Thread-safe: a blend job runs it."""
        start = time.perf_counter()
        upto = max(self.plan.check_layers) if self.in_forward else None
        done = compute(self.w, self.store, self.plan, (self.pool_k, self._v), tokens, hits,
                       salt, prefix, upto, self.cols)
        if done is not None and prefix is None and self.rows is not None:
            done = self.rows.finish(done, tokens)
        if done is not None:
            took = time.perf_counter() - start  # + SGLang's share, as it expects to take it
            if self.in_forward and not done.whole and self._prefill_s is not None:
                took += self._prefill_s(rows_to_come(done, self.plan), hits.end)
            self.planner.observe(hits.end - (prefix[0] if prefix else 0), took)
        return done

    def close(self) -> None:
        self._asks.shutdown(wait=False, cancel_futures=True)
        self.jobs.close()
        self.worker.close()
