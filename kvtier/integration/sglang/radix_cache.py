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

Store, `checkpoint` of a finished (not aborted) request: once SGLang has inserted the request's
KV, the tree node ending its prefix is locked and the prefix is queued for a background store.
The lock is released on the scheduler thread at the next tree call after the store has read the
slots (`match_prefix`, `checkpoint`, `evict*`, `has_pending_cache_operations`), or when the
store missed its deadline; so `/flush_cache` on an idle server succeeds at the first call.

Every hook runs on SGLang's scheduler thread and is timed (`kvtier_scheduler_seconds`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

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
from kvtier.integration.sglang.adapter import SGLangKVTier
from kvtier.integration.sglang.sglang_views import (
    InitLoadBackParamsView,
    KVAllocatorView,
    MatchPrefixParamsView,
    MatchResultView,
    Opaque,
    RadixKeyView,
    ReqView,
    TreeCoreView,
)

__all__ = ["KVTierRadixCache"]

logger = logging.getLogger(__name__)


def _token_array(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """A copy of SGLang's token ids as int64. Never a view: SGLang grows its token arrays in
    place (`array.extend`), which fails while any view of one is alive, and a view handed down
    the stack can outlive the call (an exception's traceback keeps every frame's locals)."""
    return np.array(ids, dtype=np.int64)


class KVTierRadixCache(UnifiedRadixCache):
    """`UnifiedRadixCache` that loads prefixes from kvtier and stores finished requests."""

    kvtier: SGLangKVTier | None = None
    # What kvtier reads of the tree it extends (set by UnifiedRadixCache.__init__; annotations
    # only: nothing is assigned here).
    disable: bool
    tree_core: TreeCoreView
    token_to_kv_pool_allocator: KVAllocatorView

    def attach_kvtier(self, kvtier: SGLangKVTier) -> None:
        """Connect the kvtier engine (once, right after construction)."""
        self.kvtier = kvtier
        # request id -> (key, device tokens, end) that match_prefix reported as a host hit
        self._promised: dict[str, tuple[RadixKeyView, int, int]] = {}
        # request id -> end of what init_load_back loaded, until the request's prefill runs
        self._loaded: dict[str, int] = {}

    # ---- load ----

    def match_prefix(self, params: MatchPrefixParamsView) -> MatchResult:
        kv = self.kvtier
        req = params.req
        if kv is None:
            return super().match_prefix(params)
        with kv.budget.timed("match_prefix", getattr(req, "rid", None)) as call:
            self._release_finished_stores()
            result: MatchResultView = super().match_prefix(params)
            if req is None or not self._eligible(params.key) or _multimodal(req):
                return result
            self._check_discarded(req.rid, result.device_prefix_len)
            hit = self._host_hit(req, params.key, result.device_prefix_len)
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
        self._promised.pop(rid, None)
        end = kv.loadable_end(len(key))
        if end <= device_len or kv.shadowed(rid, device_len):  # verified: computed, compared
            return 0
        start = time.perf_counter()
        hit = kv.lookup(rid, _full_ids(req, key), _salt(key.cache_salt), limit=end)
        prometheus.observe_hit("lookup", time.perf_counter() - start)
        if hit <= device_len:
            kv.counters.inc("sglang.load_misses")
            return 0
        self._promised[rid] = (key, device_len, hit)
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
            promise = self._promised.pop(req.rid, None)
            if promise is None or promise[1] != req.prefix_len \
                    or promise[2] - promise[1] != params.host_hit_length:
                kv.counters.inc("sglang.loads_short")
                return 0, req.last_node
            key, device_len, end = promise
            loaded = self._load(req, key, device_len, end)
            call.work = f"copied {0 if loaded is None else end - device_len} tokens in"
            if loaded is None:
                return 0, req.last_node
            self._loaded[req.rid] = end
            kv.forget(req.rid)
            return end - device_len, loaded

    def _load(self, req: ReqView, key: RadixKeyView, device_len: int, end: int) -> Opaque:
        """Copy tokens [device_len, end) from the CPU tier into new slots and insert them;
        returns the node ending the prefix, or None (nothing changed) if any is missing."""
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
        tokens = _full_ids(req, key)
        mapping = torch.full((len(tokens),), -1, dtype=torch.int64, device=slots.device)
        mapping[device_len:end] = slots
        start = time.perf_counter()
        if kv.retrieve(req.rid, tokens, mapping, skip=device_len, salt=_salt(key.cache_salt),
                       limit=end) < end:
            self.token_to_kv_pool_allocator.free(slots)  # evicted since the match: recompute
            kv.counters.inc("sglang.loads_short")
            return None
        copied = time.perf_counter()
        prometheus.observe_hit("copy", copied - start)
        prefix = self.path_device_indices(req.last_node)[:device_len]
        loaded_key = RadixKey(key.raw_token_ids()[:end], key.extra_key, cache_salt=key.cache_salt)
        # prev_prefix_len: the leading indices are the tree's own, not duplicates to free.
        self.insert(InsertParams(key=loaded_key, value=torch.cat([prefix.to(torch.int64), slots]),
                                 prev_prefix_len=device_len, inserted_len=device_len))
        matched: MatchResultView = super().match_prefix(MatchPrefixParams(key=loaded_key))
        prometheus.observe_hit("insert", time.perf_counter() - copied)
        logger.info("kvtier: loaded %d tokens at admission of %s (device had %d of %d)",
                    end - device_len, req.rid, device_len, len(key))
        if matched.device_prefix_len != end:  # never expected: recompute rather than guess
            logger.error("kvtier: inserted %d tokens but the tree matches %d; recomputing",
                         end, matched.device_prefix_len)
            return None
        return matched.last_device_node

    def _check_discarded(self, rid: str, device_len: int) -> None:
        """A request matched again after its load: count the load as discarded if the loaded
        tokens left the device before the request used them."""
        end = self._loaded.pop(rid, None)
        if end is not None and device_len < end and self.kvtier is not None:
            self.kvtier.counters.inc("sglang.loads_discarded")
            logger.warning("kvtier: request %s lost %d loaded tokens to eviction before it ran",
                           rid, end - device_len)

    def load_back_is_cache_owned(self) -> bool:
        return True  # loaded slots are inserted into the tree at once

    def _alloc(self, num_tokens: int) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        slots = allocator.alloc(num_tokens)
        if slots is None:
            allocator.evict_to_free_tokens(self, num_tokens)
            slots = allocator.alloc(num_tokens)
        return None if slots is None else slots.to(torch.int64)

    # ---- background prefetch (SGLang's storage-prefetch hooks) ----

    def is_backuped(self, node_id: Opaque) -> bool:
        # kvtier keys are rebuilt from token ids, so a prefetch may start from any node.
        return True

    def prefetch_from_storage(self, request: ReqView, last_host_node_id: Opaque,
                              new_input_tokens: Sequence[int], last_hash: Opaque = None,
                              prefix_keys: Opaque = None,
                              matched_prefix_tokens: Sequence[int] | None = None,
                              extra_key: str | None = None, cache_salt: str | None = None,
                              storage_hit_end: Opaque = None) -> None:
        """A request joined the waiting queue: start loading its chunks in the background."""
        kv = self.kvtier
        if kv is None or self.disable or extra_key is not None \
                or getattr(self.tree_core, "is_eagle", False) or _multimodal(request):
            return
        with kv.budget.timed("prefetch_from_storage", request.rid):
            tokens = np.concatenate([_token_array(matched_prefix_tokens or []),
                                     _token_array(new_input_tokens)])
            kv.start_prefetch(request.rid, tokens, _salt(cache_salt))

    def check_prefetch_progress(self, request: ReqView) -> bool:
        """Whether the waiting request may be admitted now (per `prefetch_policy`)."""
        kv = self.kvtier
        if kv is None:
            return True
        with kv.budget.timed("check_prefetch_progress", request.rid):
            self._release_finished_stores()
            return kv.prefetch_ready(request.rid)

    def pop_prefetch_loaded_span(self, request: ReqView) -> tuple[int, int | None]:
        # Prefetched chunks reach the pool through init_load_back, as host hits.
        return 0, None

    def release_aborted_request(self, request: ReqView) -> None:
        """The request is gone before admission: cancel its prefetch, free what it loaded."""
        kv = self.kvtier
        if kv is None:
            return
        with kv.budget.timed("release_aborted_request", request.rid):
            self._promised.pop(request.rid, None)
            self._loaded.pop(request.rid, None)
            kv.cancel_prefetch(request.rid)
        logger.info("kvtier: request %s aborted; the tree protects %d tokens", request.rid,
                    self.protected_size())

    def check_hicache_events(self) -> None:
        """Called by the scheduler every step: hand back the locks of finished stores."""
        kv = self.kvtier
        if kv is not None and kv.pending_stores():  # most steps have none: no timing either
            with kv.budget.timed("check_hicache_events"):
                self._release_finished_stores()

    def has_pending_cache_operations(self) -> bool:
        """Asked by the scheduler's idle check (`/flush_cache` needs False): first wait for
        the stores of finished requests to read their slots (memory speed, bounded by their
        deadline) and hand their locks back."""
        kv = self.kvtier
        if kv is None:
            return False
        if not kv.pending_stores():  # the idle loop asks every turn: no timing for nothing
            return kv.pending_prefetches() > 0
        with kv.budget.timed("has_pending_cache_operations") as call:
            call.work = f"waited for {kv.pending_stores()} stores to read their slots"
            for job in kv.settle():
                self.unlock(job.handle)
            return kv.pending_prefetches() > 0 or kv.pending_stores() > 0

    def clear_storage_backend(self) -> bool:
        logger.warning("kvtier: clearing the storage tiers over HTTP is not supported; use "
                       "`kvtier purge`")
        return False

    # ---- store ----

    def checkpoint(self, req: ReqView, *, up_to: int, **kwargs: Opaque) -> None:
        kv = self.kvtier
        if kv is None:
            return super().checkpoint(req, up_to=up_to, **kwargs)
        with kv.budget.timed("checkpoint", req.rid):
            self._release_finished_stores()
            self._loaded.pop(req.rid, None)  # its prefill ran: the load was used
            super().checkpoint(req, up_to=up_to, **kwargs)
            if req.finished():
                kv.forget(req.rid)
                if not self._aborted(req):
                    self._submit_store(req)

    @staticmethod
    def _aborted(req: ReqView) -> bool:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        return isinstance(req.finished_reason, FINISH_ABORT)

    def _submit_store(self, req: ReqView) -> None:
        kv = self.kvtier
        assert kv is not None
        node = req.last_node
        if node is None or self.disable or req.extra_key is not None or _multimodal(req):
            return
        slots = self.path_device_indices(node)
        keyed = kv.engine.keys.num_keyed_tokens(len(slots))
        if keyed == 0:
            return
        tokens = _token_array(req.full_untruncated_fill_ids)[:keyed]
        if len(tokens) < keyed:
            return
        lock = self.lock(node)
        session = getattr(req, "session", None)  # SGLang's session API: pin between turns
        sid = getattr(session, "session_id", None)
        if not kv.submit_store(tokens, slots[:keyed].to(torch.int64), lock, sid,
                               _salt(req.cache_salt), len(req.origin_input_ids), req.rid):
            self.unlock(lock)

    def _release_finished_stores(self) -> None:
        if self.kvtier is not None:
            for job in self.kvtier.poll_done():
                self.unlock(job.handle)

    def release_session(self, session_id: str) -> None:
        super().release_session(session_id)
        if self.kvtier is not None:
            self.kvtier.release_session(session_id)

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
            with kv.budget.timed("reset"):
                # A flush clears the pool: no store may still be reading it. Lower tiers are
                # flushed too, so a flush makes everything stored so far durable (bounded).
                for job in kv.settle():
                    self.unlock(job.handle)
                kv.flush(kv.engine.config.blocking_timeout_secs)
                self._promised.clear()
                self._loaded.clear()
        super().reset()

    def release_host_resources(self) -> None:
        """SGLang's graceful stop (SIGTERM to the launcher): the scheduler left its loop; kvtier
        writes what it has queued (bounded) and logs what it drained and dropped."""
        if self.kvtier is not None:
            from kvtier.integration.sglang.shutdown import drain_and_log

            drain_and_log(self.kvtier)
        super().release_host_resources()

    def shutdown(self) -> None:
        if self.kvtier is not None:
            for job in self.kvtier.settle():
                self.unlock(job.handle)
            self.kvtier.close()
        super().shutdown()


def _multimodal(req: ReqView) -> bool:
    """Whether a request carries images, audio or video. SGLang puts values derived from each
    item's hash into the token ids in its place, and a client may choose that hash itself
    (`mm_hashes`); keyed fleet-wide and kept for days, a collision of those (made on purpose,
    or by a weak hash) would serve one image's KV for another, and token verification cannot
    see it. So such requests bypass kvtier (the HiCache backend refuses such models)."""
    return getattr(req, "multimodal_inputs", None) is not None


def _full_ids(req: ReqView, key: RadixKeyView) -> np.ndarray:
    """The request's whole token sequence: the match key stops before the last prompt token,
    but the chunk holding it is named by all of its tokens (and loads in part)."""
    matched = _token_array(key.raw_token_ids())
    full = getattr(req, "full_untruncated_fill_ids", None)
    ids = _token_array(full) if full else matched
    if len(ids) < len(matched) or not np.array_equal(ids[:len(matched)], matched):
        return matched  # never expected: trust the key alone
    return ids


def _salt(cache_salt: str | None) -> str:
    """A request's `cache_salt` as kvtier mixes it into its keys ("" for none)."""
    return "" if cache_salt is None else str(cache_salt)
