"""SGLang's unified radix tree with kvtier underneath (`--radix-cache-backend kvtier`).

Prefetch, when a request joins the waiting queue: SGLang's storage-prefetch hooks
(`prefetch_from_storage`, `check_prefetch_progress`, `release_aborted_request`; the plugin turns
the scheduler's gate for them on) start a background load of the request's chunks from disk or
Redis into kvtier's CPU tier. The scheduler keeps the request waiting while
`check_prefetch_progress` says so (per `prefetch_policy`) and runs the other requests meanwhile,
so a slow tier never stalls a running stream.

Load, SGLang's own admission contract: `match_prefix` reports the whole chunks kvtier's CPU
tier holds past the device hit as a host hit (metadata only: no slot is allocated and nothing
is copied for a request that may not run). When the scheduler admits the request it has
checked there is room (`prepare_load_back`) and calls `init_load_back`: kvtier then allocates
slots, copies the chunks in and inserts them into the tree like computed KV, all of the
promised tokens or none. A load that is evicted before its request used it is counted in
`kvtier_sglang_loads_discarded_total`.

Store, `checkpoint` of a finished request (aborted ones too: what they prefilled;
`store_hooks.StoreHooks`): once SGLang has inserted the request's KV, the tree node ending its
prefix is locked and the prefix is queued for a background store.
The lock is released on the scheduler thread at the next tree call after the store has read the
slots (`match_prefix`, `checkpoint`, `evict*`, `has_pending_cache_operations`), or when the
store missed its deadline; so `/flush_cache` on an idle server succeeds at the first call.

Blend, with `enable_blending` (`blending.SGLangBlender`): when the CPU tier holds more of a
request's segments than of its prefix, the match promises those tokens as the host hit and
`init_load_back` computes them blended into the new slots instead of copying chunks. Their
slots are marked, and a store stops at the first marked slot; an opted-out or verified request
matches only up to it (`_exact_match`).

Prefetch and the idle checks are `prefetch_hooks.StoragePrefetchHooks`; a finished request
reaches the blender, and the blend's match and admission run, in `blend_hooks.BlendHooks`
(which also tells SGLang how many blended tokens came from the cache). Every hook runs on
SGLang's scheduler thread and is timed (`kvtier_scheduler_seconds`).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvtier import prometheus
from kvtier.integration.sglang.blending.blend_hooks import BlendHooks
from kvtier.integration.sglang.blending.blended_slots import BlendedSlots
from kvtier.integration.sglang.blending.blender import SegmentHits, SGLangBlender
from kvtier.integration.sglang.boundary.sglang_views import (
    InitLoadBackParamsView,
    KVAllocatorView,
    MatchPrefixParamsView,
    MatchResultView,
    Opaque,
    RadixKeyView,
    ReqView,
    TreeCoreView,
)
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from kvtier.integration.sglang.rank.prefetch_hooks import StoragePrefetchHooks
from kvtier.integration.sglang.rank.request_state import Loaded, Promise
from kvtier.integration.sglang.rank.requests import (
    full_ids,
    multimodal,
    salt_of,
)
from kvtier.integration.sglang.rank.store_hooks import StoreHooks
from kvtier.integration.sglang.rank.tier_events import TierEvents

__all__ = ["KVTierRadixCache"]

logger = logging.getLogger(__name__)


class KVTierRadixCache(StoragePrefetchHooks, BlendHooks, StoreHooks, UnifiedRadixCache):
    """`UnifiedRadixCache` that loads prefixes from kvtier and stores finished requests."""

    kvtier: SGLangKVTier | None = None
    blender: SGLangBlender | None = None
    _blended: BlendedSlots | None = None  # reset() runs in UnifiedRadixCache.__init__
    _tier_events: TierEvents | None = None
    # What kvtier reads of the tree it extends (set by UnifiedRadixCache.__init__; annotations
    # only: nothing is assigned here).
    disable: bool
    tree_core: TreeCoreView
    token_to_kv_pool_allocator: KVAllocatorView

    def attach_kvtier(self, kvtier: SGLangKVTier) -> None:
        """Connect the kvtier engine (once, right after construction)."""
        self.kvtier = kvtier  # its `requests` hold each request's promise and load

    def publish_tier_events(self, events: TierEvents) -> None:
        """Publish kvtier's tier changes beside the device's KV events (`--kv-events-config`;
        once, after `attach_kvtier`)."""
        assert self.kvtier is not None
        self._tier_events = events
        self.kvtier.engine.tiers.watch(events)

    def take_events(self) -> list[Opaque]:
        """The device's KV events, then kvtier's tiers' (`tier_events.py`)."""
        events: list[Opaque] = super().take_events()
        return events + self._tier_events.take() if self._tier_events is not None else events

    def attach_blender(self, blender: SGLangBlender, num_slots: int,
                       device: torch.device) -> None:
        """Blend requests whose segments the tiers hold (`enable_blending`; once, after
        `attach_kvtier`, over a pool of `num_slots` slots on `device`)."""
        self.blender = blender
        self._blended = BlendedSlots(self.token_to_kv_pool_allocator, num_slots, device)

    # ---- load ----

    def match_prefix(self, params: MatchPrefixParamsView) -> MatchResult:
        kv = self.kvtier
        req = params.req
        if kv is None:
            return super().match_prefix(params)
        with kv.budget.timed("match_prefix", getattr(req, "rid", None)) as call:
            self._release_finished_stores()
            result: MatchResultView = super().match_prefix(params)
            if req is None or not self._eligible(params.key) or multimodal(req):
                return result
            exact = self._exact_match(req, params, result)
            if exact is not None:  # nothing loaded: it would be inserted beside blended KV
                return exact
            self._check_discarded(req, result.device_prefix_len)
            hit = self._host_hit(req, params.key, result.device_prefix_len)
            hits = self._blend_hit(req, params.key, result.device_prefix_len, hit)
            if hits is not None:  # a blend gives more: promised instead of the prefix load
                kv.requests.open(req.rid).promise = Promise(
                    params.key, result.device_prefix_len, hits.end, hits)
                hit = hits.end - result.device_prefix_len
            if hit > 0:
                call.work = f"CPU-tier hit of {hit} tokens"
                result = result._replace(host_hit_length=hit)
            return result

    def _eligible(self, key: RadixKeyView) -> bool:
        # kvtier keys cover token ids and a per-request cache_salt: LoRA adapters (extra_key)
        # and EAGLE bigram keys would need their own namespace, so they bypass kvtier.
        return key.extra_key is None and not key.is_bigram and not self.disable

    def _host_hit(self, req: ReqView, key: RadixKeyView, device_len: int) -> int:
        """Tokens past the device hit kvtier can load at admission (whole pages, agreed by
        every rank); remembered as this request's promise for `init_load_back`."""
        kv = self.kvtier
        assert kv is not None
        rid = req.rid
        kv.requests.open(rid).promise = None
        end = kv.loadable_end(len(key))
        if end <= device_len or kv.shadowed(rid, device_len):  # verified: computed, compared
            return 0
        start = time.perf_counter()
        hit = kv.lookup(rid, full_ids(req, key), salt_of(key.cache_salt), limit=end)
        prometheus.observe_hit("lookup", time.perf_counter() - start)
        if hit <= device_len:
            kv.counters.inc("sglang.load_misses")
            return 0
        hit = kv.shadow_tail(rid, device_len, hit)  # verified by its last chunk: computed
        if hit <= device_len:
            return 0
        kv.requests.open(rid).promise = Promise(key, device_len, hit, None)
        return hit - device_len

    def init_load_back(self, params: InitLoadBackParamsView) -> tuple[int, Opaque] | None:
        """The scheduler admitted a request with a kvtier host hit and made room for it: copy
        the promised chunks into new slots and insert them. Returns (tokens loaded, the node
        ending the loaded prefix): all promised tokens or (0, the request's device node)."""
        kv = self.kvtier
        req = params.req
        if kv is None or req is None:
            return 0, getattr(req, "last_node", None)
        with kv.budget.timed("init_load_back", req.rid) as call:
            state = kv.requests.get(req.rid)
            promise = None if state is None else state.promise
            if state is not None:
                state.promise = None
            if state is None or promise is None or promise.device_len != req.prefix_len \
                    or promise.end - promise.device_len != params.host_hit_length:
                kv.counters.inc("sglang.loads_short")
                return 0, req.last_node
            key, device_len, end, hits = promise
            loaded = self._load(req, key, device_len, end, hits)
            call.work = f"copied {0 if loaded is None else end - device_len} tokens in"
            if loaded is None:
                return 0, req.last_node
            node, kept = loaded
            computed = 0 if hits is None else self._report_blend(req, end - device_len, kept)
            state.loaded = Loaded(end, computed)
            kv.loaded(req.rid)
            return end - device_len, node

    def _load(self, req: ReqView, key: RadixKeyView, device_len: int, end: int,
              hits: SegmentHits | None) -> tuple[Opaque, int] | None:
        """Copy tokens [device_len, end) from the CPU tier (or blend them from `hits`) into
        new slots and insert them; returns the node ending the prefix and how many of the
        tokens came from the cache, or None (nothing changed) if any is missing."""
        kv = self.kvtier
        assert kv is not None
        # The scheduler holds a lock on the device prefix (`_lock_node`) while it admits.
        slots = self._alloc(end - device_len)
        if not kv.agree_min(int(slots is not None)):  # ranks agree before retrieve's collective
            if slots is not None:
                self.token_to_kv_pool_allocator.free(slots)
            kv.counters.inc("sglang.load_no_slots")
            return None
        assert slots is not None
        tokens = full_ids(req, key)
        prefix = self.path_device_indices(req.last_node)[:device_len]
        start = time.perf_counter()
        kept = self._fill(req.rid, tokens, key, device_len, end, hits, prefix, slots)
        if kept is None:
            self.token_to_kv_pool_allocator.free(slots)  # evicted since the match: recompute
            return None
        copied = time.perf_counter()
        prometheus.observe_hit("copy" if hits is None else "blend", copied - start)
        loaded_key = RadixKey(key.raw_token_ids()[:end], key.extra_key, cache_salt=key.cache_salt)
        if hits is not None and self._blended is not None:
            # Approximate KV, never stored as a prefix; marked before the insert, which frees
            # (and so unmarks) any slot the tree already holds computed KV for.
            self._blended.mark(slots)
        # prev_prefix_len: the leading indices are the tree's own, not duplicates to free.
        self.insert(InsertParams(key=loaded_key, value=torch.cat([prefix.to(torch.int64), slots]),
                                 prev_prefix_len=device_len, inserted_len=device_len))
        matched: MatchResultView = super().match_prefix(MatchPrefixParams(key=loaded_key))
        prometheus.observe_hit("insert", time.perf_counter() - copied)
        logger.info("kvtier: %s %d tokens at admission of %s (device had %d of %d)",
                    "loaded" if hits is None else "blended", end - device_len, req.rid,
                    device_len, len(key))
        if matched.device_prefix_len != end:  # never expected: recompute rather than guess
            logger.error("kvtier: inserted %d tokens but the tree matches %d; recomputing",
                         end, matched.device_prefix_len)
            return None
        return matched.last_device_node, kept

    def _fill(self, rid: str, tokens: np.ndarray, key: RadixKeyView, device_len: int, end: int,
              hits: SegmentHits | None, prefix: torch.Tensor, slots: torch.Tensor) -> int | None:
        """Write tokens [device_len, end) into `slots`: a CPU-tier load (all of them from the
        cache), or a blend (`_blend_into`); None if nothing could be written."""
        kv = self.kvtier
        assert kv is not None
        salt = salt_of(key.cache_salt)
        if hits is not None:
            return self._blend_into(rid, tokens, hits, device_len, prefix, slots, salt)
        mapping = torch.full((len(tokens),), -1, dtype=torch.int64, device=slots.device)
        mapping[device_len:end] = slots
        if kv.retrieve(rid, tokens, mapping, skip=device_len, salt=salt, limit=end) >= end:
            return end - device_len
        kv.counters.inc("sglang.loads_short")
        return None

    def _check_discarded(self, req: ReqView, device_len: int) -> None:
        """A request matched again after its load: count the load as discarded if the loaded
        tokens left the device before the request used them (and take back what a blend told
        SGLang: the request is admitted anew)."""
        state = self.kvtier.requests.get(req.rid) if self.kvtier is not None else None
        loaded = None if state is None else state.loaded
        if state is None or loaded is None:
            return
        state.loaded = None
        end, computed = loaded
        if computed:
            self._unreport_blend(req, computed)
        if device_len < end and self.kvtier is not None:
            self.kvtier.counters.inc("sglang.loads_discarded")
            logger.warning("kvtier: request %s lost %d loaded tokens to eviction before it ran",
                           req.rid, end - device_len)

    def load_back_is_cache_owned(self) -> bool:
        return True  # loaded slots are inserted into the tree at once

    def _alloc(self, num_tokens: int) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        slots = allocator.alloc(num_tokens)
        if slots is None:
            allocator.evict_to_free_tokens(self, num_tokens)
            slots = allocator.alloc(num_tokens)
        return None if slots is None else slots.to(torch.int64)

    def release_aborted_request(self, request: ReqView) -> None:
        """The request is gone before admission: cancel its prefetch, free what it loaded."""
        kv = self.kvtier
        if kv is None:
            return
        with kv.budget.timed("release_aborted_request", request.rid):
            if self.blender is not None:
                self.blender.cancel_prefetch(request.rid)
                self.blender.forget(request.rid)
            kv.cancel_prefetch(request.rid)  # forgets its promise and load too
        logger.info("kvtier: request %s aborted; the tree protects %d tokens", request.rid,
                    self.protected_size())

    # ---- eviction and reset ----

    def evict(self, params: EvictParams) -> Opaque:
        self._release_finished_stores()
        return super().evict(params)

    def evict_for_alloc(self, params: EvictParams, *args: Opaque, **kwargs: Opaque) -> Opaque:
        self._release_finished_stores()
        return super().evict_for_alloc(params, *args, **kwargs)

    def reset(self) -> None:
        kv = self.kvtier  # None while UnifiedRadixCache.__init__ runs
        if kv is not None:
            with kv.budget.timed("reset") as call:
                call.streams_waited = self.protected_size() > 0  # SGLang flushes when idle
                # A flush clears the pool: no store may still be reading it. Lower tiers are
                # flushed too, so a flush makes everything stored so far durable (bounded).
                for job in kv.settle():
                    self.unlock(job.handle)
                kv.flush(kv.engine.config.blocking_timeout_secs)
                kv.requests.drop_loads()
        if self.blender is not None:
            self.blender.forget()
        if self._blended is not None:
            self._blended.clear()  # the pool is emptied
        super().reset()

    def release_host_resources(self) -> None:
        """SGLang's graceful stop (SIGTERM to the launcher): the scheduler left its loop; kvtier
        writes what it has queued (bounded) and logs what it drained and dropped."""
        if self.kvtier is not None:
            from kvtier.integration.sglang.stop.shutdown import drain_and_log

            drain_and_log(self.kvtier)
        super().release_host_resources()

    def shutdown(self) -> None:
        if self.blender is not None:
            self.blender.close()
        if self.kvtier is not None:
            for job in self.kvtier.settle():
                self.unlock(job.handle)
            self.kvtier.close()
        super().shutdown()

