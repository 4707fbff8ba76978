"""Blended prefill on SGLang (`enable_blending`): reuse of segments at any position.

At a request's match (`KVTierRadixCache.match_prefix`) the blender finds its segments (runs
ended by `blend_special_str`) past the device prefix and asks the CPU tier which it holds
(metadata only). When they hold more tokens than a prefix load would give, the match promises
them as a host hit; at admission (`init_load_back`) the blender computes the prompt, all but
its last token, over that KV (`kvtier.blend`: segments re-rotated to where they stand, the
device prefix read from the pool, a share of the cached tokens recomputed from the check
layers on) with the served model's own weights, and writes it into the slots the tree inserts.
SGLang then computes the last token and decodes as usual.

Blended KV is an approximation, so it never becomes a prefix record: its slots are marked
(`BlendedSlots`) and a store stops at the first marked slot. It stays in SGLang's device tree
like computed KV until evicted (a later request of the same prefix on this server reuses it).

Segments a request missed are computed alone (position 0) on a background thread, while a CPU
engine is quiet (`background.ENGINE`), and put in the tiers for the next prompt that holds them;
a request that verification samples has its segments' records compared with them computed
alone again there (`blend_worker.SegmentWorker`).

Limits, refused at launch by name: tensor parallel above 1, MLA, models other than Llama-family
decoders with linear RoPE, packed or quantized weights, a KV pool of another dtype.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvtier.blend.assemble import Assembled, assemble
from kvtier.blend.forward import BlendPlan, LlamaWeights, blend
from kvtier.blend.planner import BlendPlanner, Choice
from kvtier.blend.segments import Segment
from kvtier.blend.store import SegmentStore
from kvtier.config.schema import BlendSection
from kvtier.engine import Prefetch
from kvtier.errors import ConfigError
from kvtier.integration.sglang.blend_chains import SegmentChains
from kvtier.integration.sglang.blend_model import separator_ids, served_weights
from kvtier.integration.sglang.blend_worker import WORKER_COUNTERS, SegmentWorker
from kvtier.integration.sglang.sglang_views import Opaque, ReqView
from kvtier.keys import KeyChain
from kvtier.metrics import Counters

__all__ = ["BLEND_COUNTERS", "BlendedSlots", "SGLangBlender", "SegmentHits", "wants_blend"]

logger = logging.getLogger(__name__)

BLEND_COUNTERS = ("blend_requests", "blend_segments_hit", "blend_tokens_loaded",
                  "blend_tokens_recomputed", *WORKER_COUNTERS, "blend_segments_capped",
                  "blend_failures", "blend_fallbacks_slower", "blend_probes")
MAX_REQUESTS = 4096  # requests whose segments are remembered from match to finish
REQUEST_SWITCH = "kvtier_blend"  # sampling_params.custom_params key: false opts a request out


def wants_blend(req: ReqView) -> bool:
    """Whether `req` may blend: blending is on unless its `custom_params` say
    `{"kvtier_blend": false}`."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return not (isinstance(params, dict) and params.get(REQUEST_SWITCH) is False)


class SegmentHits(NamedTuple):
    """A prompt's segments past its device prefix, up to `end` (the tokens a blend computes):
    those the CPU tier holds (`held`, `cached` tokens of them, `chains` their key chains) and
    those it lacks."""

    end: int
    held: tuple[Segment, ...]
    missed: tuple[Segment, ...]
    cached: int
    chains: tuple[KeyChain, ...] = ()


class BlendedSlots:
    """Which pool slots hold blended KV. A mark is set when a blend writes a slot and cleared
    when the allocator frees it (its `free` is wrapped) or the pool is reset."""

    def __init__(self, allocator: Opaque, num_slots: int, device: torch.device):
        self._marks = torch.zeros(num_slots, dtype=torch.bool, device=device)
        original: Callable[[torch.Tensor], Opaque] = allocator.free

        def free(free_index: torch.Tensor) -> Opaque:
            self._marks[free_index.to(self._marks.device, torch.int64)] = False
            return original(free_index)

        allocator.free = free

    def mark(self, slots: torch.Tensor) -> None:
        self._marks[slots.to(self._marks.device, torch.int64)] = True

    def exact_prefix(self, slots: torch.Tensor) -> int:
        """How many leading `slots` hold no blended KV."""
        marked = self._marks[slots.to(self._marks.device, torch.int64)].nonzero()
        return int(marked[0, 0]) if len(marked) else len(slots)

    def clear(self) -> None:
        self._marks.zero_()


class SGLangBlender:
    """Blends for one TP-1 scheduler. Built by `from_scheduler` after SGLang loaded the model.

    Args:
        weights: the served model's tensors (`blend_model.served_weights`).
        store: the segment store in the engine's tiers (`CacheEngine.segments`).
        section: the config's blending keys.
        separator: `blend_special_str` as token ids.
        pool: the KV pool's per-layer K and V buffers (`[slots, kv_heads, head_dim]`).
        page_size: SGLang's page size (a blend ends on a page boundary).
        counters: where `BLEND_COUNTERS` are counted (the adapter's).
    """

    def __init__(self, weights: LlamaWeights, store: SegmentStore, section: BlendSection,
                 separator: Sequence[int], pool: tuple[Sequence[torch.Tensor],
                                                       Sequence[torch.Tensor]],
                 page_size: int, counters: Counters):
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
        self.page_size = page_size
        self.counters = counters
        self.chains = SegmentChains(store, self.separator, section.min_tokens, counters)
        self.worker = SegmentWorker(weights, store, self.separator, section.min_tokens,
                                    self.chains.max_segments, counters)
        self._hits: dict[str, SegmentHits] = {}  # request id -> its segments at its match
        self.planner = BlendPlanner(section.max_prefill_ratio)
        self._choices: dict[str, Choice] = {}  # request id -> blend or compute, made once
        self._prefetches: dict[str, list[Prefetch]] = {}  # request id -> its segment loads
        self._hinted = False  # the preamble hint (`_hint_preamble`) was logged

    # ---- admission (scheduler thread) ----

    def look(self, rid: str, tokens: np.ndarray, device_len: int, salt: str) -> SegmentHits:
        """`tokens`' segments past `device_len` and what the CPU tier holds of them
        (remembered for request `rid`'s `finished`). The segments and their keys are found
        once per request (`chains`); the CPU tier is asked at every call."""
        n = len(tokens) - 1  # SGLang computes the last prompt token itself
        end = n - n % self.page_size
        held: list[Segment] = []
        chains: list[KeyChain] = []
        missed: list[Segment] = []
        cached = 0
        prompt = self.chains.of(rid, tokens, salt)
        for seg, chain in zip(prompt.segments, prompt.chains):
            if seg.end + len(self.separator) > end:
                break  # its separator is not computed by the blend: the rest are not either
            if seg.end <= device_len:
                continue  # in the pool already, exact
            got = self.store.lookup(chain, hot_only=True)
            (held if got else missed).append(seg)
            if got:
                chains.append(chain)
            if got < seg.num_tokens and got:
                missed.append(seg)  # its tail was evicted: computed again, stored again
            # What the pool holds of it stays (exact); the rest is what the segment adds.
            cached += max(0, seg.start + got - max(seg.start, device_len))
        hits = SegmentHits(end, tuple(held), tuple(missed), cached, tuple(chains))
        if held and not self._hinted and prompt.segments:
            self._hint_preamble(rid, prompt.segments[0], hits, device_len)
        if len(self._hits) >= MAX_REQUESTS:
            self._hits.clear()  # requests that never came back
        self._hits[rid] = hits
        return hits

    def worth(self, rid: str, hits: SegmentHits, device_len: int,
              prefill_s: Callable[[int, int], float]) -> bool:
        """Whether request `rid` should blend `hits` rather than have SGLang compute tokens
        `[device_len, hits.end)` (`prefill_s(tokens, prompt_len)`: the engine's measured
        estimate): decided at its first match and kept (SGLang may match it again); a
        fallback is counted once, and logged."""
        choice = self._choices.get(rid)
        if choice is None:
            tokens = hits.end - device_len
            choice = self.planner.choose(tokens, prefill_s(tokens, hits.end))
            if len(self._choices) >= MAX_REQUESTS:
                self._choices.clear()  # requests that never came back
            self._choices[rid] = choice
            if choice.reason == "probe":
                self.counters.inc("sglang.blend_probes")
            if not choice.blend:
                self.counters.inc("sglang.blend_fallbacks_slower")
                logger.info("kvtier: %s computed, not blended: a blend of %d tokens would take "
                            "%.2fs, the full prefill %.2fs (blend_max_prefill_ratio %g)", rid,
                            tokens, choice.blend_s, choice.prefill_s, self.planner.max_ratio)
        return choice.blend

    def _hint_preamble(self, rid: str, first: Segment, hits: SegmentHits,
                       device_len: int) -> None:
        """Once per server: the run that starts a prompt (no separator before it) missed while
        later segments hit. A preamble that no separator ends is one segment with the first
        document, which then misses wherever that document stands elsewhere
        (docs/blending.md, "Turning it on")."""
        if first.start != 0 or first.end <= device_len or first in hits.held \
                or first not in hits.missed:
            return
        self._hinted = True
        logger.warning("kvtier: %s: the %d tokens before the first separator were not found as "
                       "a segment, while %d later segments were. If a preamble (a system "
                       "prompt, a chat template's opening) stands before the first document, "
                       "end it with the separator too (%r): otherwise that document is cached "
                       "only together with the preamble (logged once; docs/blending.md, "
                       "\"Turning it on\")", rid, first.num_tokens, len(hits.held),
                       self.section.separator)

    def prefetch(self, rid: str, tokens: np.ndarray, salt: str) -> None:
        """Request `rid` joined the waiting queue: start loading its segments that only disk
        or Redis hold into the CPU tier, where its match looks for them."""
        loads = [load for chain in self.chains.of(rid, tokens, salt).chains
                 if (load := self.store.start_prefetch(chain))]
        if loads:
            if len(self._prefetches) >= MAX_REQUESTS:
                self._prefetches.clear()  # requests that never came back
            self._prefetches[rid] = loads

    def prefetch_ready(self, rid: str) -> bool:
        """Whether request `rid`'s segment loads let it be admitted (per `prefetch_policy`);
        once they do, they stop (what arrived stays in the CPU tier)."""
        loads = self._prefetches.get(rid)
        if loads is None:
            return True
        if not all(load.ready() for load in loads):
            return False
        for load in self._prefetches.pop(rid):
            load.cancel()
        return True

    def cancel_prefetch(self, rid: str) -> None:
        """Request `rid` went away before admission: stop its segment loads."""
        for load in self._prefetches.pop(rid, []):
            load.cancel(drop=True)

    def finished(self, rid: str, tokens: np.ndarray, salt: str, aborted: bool,
                 verified: bool = False) -> None:
        """Request `rid` (prompt `tokens`) finished: queue the segments it missed for a
        standalone prefill and, when verification sampled it (`verified`), the records of its
        segments for a comparison with them computed alone (`SegmentWorker`)."""
        hits = self._hits.pop(rid, None)
        self._choices.pop(rid, None)
        self.chains.forget(rid)
        if aborted:
            return
        if hits is not None and hits.missed:
            self.worker.warm(tokens, hits.missed, salt)
        if verified:
            self.worker.verify(tokens, salt)

    def forget(self, rid: str | None = None) -> None:
        """Drop what was remembered of request `rid` (of every request when None)."""
        self.chains.forget(rid)
        if rid is None:
            self._hits.clear()
            self._choices.clear()
        else:
            self._hits.pop(rid, None)
            self._choices.pop(rid, None)

    @torch.inference_mode()
    def fill(self, rid: str, tokens: np.ndarray, hits: SegmentHits, device_len: int,
             prefix_slots: torch.Tensor, slots: torch.Tensor, salt: str) -> int | None:
        """Compute tokens `[device_len, hits.end)` blended and write them into `slots`.

        Returns:
            How many of them kept their cached KV past the check layers (loaded and not
            recomputed: what SGLang may count as `cached_tokens`; every other one was
            computed), or None (nothing written) when no held segment could be read any more.
        """
        start = time.perf_counter()
        w, end = self.w, hits.end
        dev = w.embed.device
        ids = torch.from_numpy(np.ascontiguousarray(tokens[:end])).to(dev)
        known = assemble(self.store, w.rope, tokens[:end].tolist(), hits.held,
                         num_layers=w.num_layers, num_kv_heads=w.num_kv_heads,
                         head_dim=w.head_dim, dtype=w.embed.dtype, device=dev, salt=salt,
                         chains=hits.chains or None)
        if not known.segments_hit:
            self.counters.inc("sglang.blend_failures")
            return None
        cached = known.cached.clone()
        if device_len:
            rows = prefix_slots.to(dev, torch.int64)
            for layer in range(w.num_layers):
                known.kv[0, layer, :device_len] = self.pool_k[layer][rows].view(device_len, -1)
                known.kv[1, layer, :device_len] = self._v[layer][rows].view(device_len, -1)
            cached[:device_len] = True
        loaded_at = time.perf_counter()
        with _compute_threads(dev) as threads:
            out = blend(w, ids, known.kv, cached, self.plan, must=known.must, logits=False)
        dst = slots.to(dev, torch.int64)
        shape = (end - device_len, w.num_kv_heads, w.head_dim)
        for layer in range(w.num_layers):
            self.pool_k[layer][dst] = out.kv[0, layer, device_len:].reshape(shape)
            self._v[layer][dst] = out.kv[1, layer, device_len:].reshape(shape)
        if dev.type == "cuda":  # SGLang's forward reads the slots on a stream of its own
            torch.cuda.current_stream(dev).synchronize()
        loaded, recomputed, kept = self._account(known, out.computed, device_len)
        self.planner.observe(end - device_len, time.perf_counter() - start)
        logger.info("kvtier: blended %s: %d tokens from %d segments at new positions, %d of them "
                    "recomputed from layer %d, %d computed (device prefix %d); cached_tokens "
                    "%d (the device prefix and the %d kept from the cache); read %.2fs, "
                    "computed %.2fs (%d threads)", rid, loaded, known.segments_hit,
                    recomputed, self.plan.check_layers[0], end - device_len - loaded,
                    device_len, device_len + kept, kept, loaded_at - start,
                    time.perf_counter() - loaded_at, threads)
        return kept

    def _account(self, known: Assembled, computed: torch.Tensor,
                 device_len: int) -> tuple[int, int, int]:
        """Count a blend (`BLEND_COUNTERS`). Returns the tokens past `device_len` it loaded,
        those of them recomputed (the share), and those that kept their cached KV (loaded,
        and not computed in the last layer: neither the share nor a segment's first token)."""
        new = torch.zeros_like(known.cached)
        new[device_len:] = True  # what the pool held stays; count what the blend wrote
        loaded = int((known.cached & new).sum())
        recomputed = int((known.cached & new & ~known.must)[computed].sum())
        last = torch.zeros_like(new)
        last[computed] = True
        kept = int((known.cached & new & ~last).sum())
        self.counters.inc("sglang.blend_requests")
        self.counters.inc("sglang.blend_segments_hit", known.segments_hit)
        self.counters.inc("sglang.blend_tokens_loaded", loaded)
        self.counters.inc("sglang.blend_tokens_recomputed", recomputed)
        return loaded, recomputed, kept

    def close(self) -> None:
        self.worker.close()

    @classmethod
    def from_scheduler(cls, scheduler: Opaque, store: SegmentStore, section: BlendSection,
                       page_size: int, counters: Counters) -> SGLangBlender:
        """The blender over `scheduler`'s served model; `ConfigError` naming why this server
        cannot blend."""
        args = scheduler.server_args
        if int(getattr(args, "tp_size", 1)) > 1 or int(getattr(args, "dp_size", 1)) > 1:
            raise ConfigError("enable_blending: blending runs at tensor and data parallel 1 "
                              "only (each rank would blend its own shard apart); drop --tp/--dp "
                              "or enable_blending")
        model = scheduler.tp_worker.model_runner.model
        weights = served_weights(model)
        pool = scheduler.tp_worker.model_runner.token_to_kv_pool
        k, v = list(pool.k_buffer), list(pool.v_buffer)
        if k[0].dtype != weights.embed.dtype:
            raise ConfigError(f"enable_blending: the KV pool holds {k[0].dtype} and the model "
                              f"computes in {weights.embed.dtype}; blending needs one dtype "
                              "(drop --kv-cache-dtype)")
        if getattr(scheduler, "tokenizer", None) is None:
            raise ConfigError("enable_blending: the server has no tokenizer to find "
                              "blend_special_str with (--skip-tokenizer-init)")
        separator = separator_ids(scheduler.tokenizer, section.separator)
        return cls(weights, store, section, separator, (k, v), page_size, counters)


@contextlib.contextmanager
def _compute_threads(device: torch.device) -> Iterator[int]:
    """On a CPU, every core this process may use for the blend's forward: SGLang's scheduler
    thread runs with one (its forward passes run on another thread), which made a blend take
    three times as long as the same forward offline."""
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
