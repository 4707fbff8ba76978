"""SGLang's unified radix tree with kvtier underneath (`--radix-cache-backend kvtier`).

Prefetch, when a request joins the waiting queue: SGLang's storage-prefetch hooks
(`prefetch_from_storage`, `check_prefetch_progress`, `release_aborted_request`; the plugin turns
the scheduler's gate for them on) start a background load of the request's chunks from disk or
Redis into kvtier's CPU tier. The scheduler keeps the request waiting while
`check_prefetch_progress` says so (per `prefetch_policy`) and runs the other requests meanwhile,
so a slow tier never stalls a running stream.

Load point, `match_prefix` with a request: after the device tree has matched, kvtier's CPU tier
is asked for whole chunks beyond the device hit (a memory copy; nothing slower runs on the
scheduler thread). A hit is scattered into freshly allocated pool slots and
inserted into the tree like computed KV, then the match is repeated, so the scheduler sees an
ordinary (longer) device prefix and needs no new code path. The loaded slots belong to the tree
from then on: an abort, an eviction or a flush frees them the usual way.

Store point, `checkpoint` of a finished (not aborted) request: once SGLang has inserted the
request's KV, the tree node ending its prefix is locked and the prefix is queued for a
background store. The lock keeps those slots from being evicted or reused while the store reads
them; it is released on the scheduler thread at the next tree call after the store finished
(`match_prefix`, `checkpoint`, `evict*`), and `reset` (`/flush_cache`) waits for all stores.
"""

from __future__ import annotations

import logging
from typing import Any

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

from kvtier.integration.sglang.adapter import SGLangKVTier

__all__ = ["KVTierRadixCache"]

logger = logging.getLogger(__name__)


def _token_array(ids: Any) -> np.ndarray:
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False)
    try:  # array('q') and other buffers: no per-element boxing
        return np.frombuffer(memoryview(ids), dtype=np.int64)
    except (TypeError, ValueError):
        return np.asarray(ids, dtype=np.int64)


class KVTierRadixCache(UnifiedRadixCache):
    """`UnifiedRadixCache` that loads prefixes from kvtier and stores finished requests."""

    kvtier: SGLangKVTier | None = None

    def attach_kvtier(self, kvtier: SGLangKVTier) -> None:
        """Connect the kvtier engine (once, right after construction)."""
        self.kvtier = kvtier

    # ---- load ----

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        self._release_finished_stores()
        result = super().match_prefix(params)
        if self.kvtier is None or params.req is None or not self._eligible(params.key):
            return result
        if self._load(params.key, result) > 0:
            result = super().match_prefix(params)
        return result

    def _eligible(self, key: RadixKey) -> bool:
        # kvtier keys cover token ids only: LoRA adapters (extra_key), per-tenant salts and
        # EAGLE bigram keys would need their own namespace, so they bypass kvtier.
        return key.extra_key is None and key.cache_salt is None and not key.is_bigram \
            and not self.disable

    def _load(self, key: RadixKey, result: MatchResult) -> int:
        """Load whole chunks past the device hit into new slots in the tree; returns tokens."""
        kv = self.kvtier
        assert kv is not None
        device_len = result.device_prefix_len
        end = kv.loadable_end(len(key))
        if end <= device_len:
            return 0
        tokens = _token_array(key.raw_token_ids())[:end]
        hit = kv.lookup(tokens)
        if hit <= device_len:
            kv.counters.inc("sglang.load_misses")
            return 0
        # The matched prefix must survive any eviction our allocation triggers.
        lock = self.lock(result.last_device_node)
        try:
            slots = self._alloc(hit - device_len)
            # Ranks must agree before the next collective (in retrieve), or they deadlock.
            if not kv.agree_min(int(slots is not None)):
                if slots is not None:
                    self.token_to_kv_pool_allocator.free(slots)
                kv.counters.inc("sglang.load_no_slots")
                return 0
            assert slots is not None
            mapping = torch.full((hit,), -1, dtype=torch.int64, device=slots.device)
            mapping[device_len:] = slots
            got = kv.retrieve(tokens[:hit], mapping, skip=device_len)
            if got < hit:
                self.token_to_kv_pool_allocator.free(slots[got - device_len:])
            if got <= device_len:
                return 0
            prefix = self.path_device_indices(result.last_device_node)[:device_len]
            value = torch.cat([prefix.to(torch.int64), slots[: got - device_len]])
            # prev_prefix_len: the leading indices are the tree's own, not duplicates to free.
            self.insert(InsertParams(
                key=RadixKey(key.raw_token_ids()[:got], key.extra_key,
                             cache_salt=key.cache_salt),
                value=value, prev_prefix_len=device_len, inserted_len=device_len))
        finally:
            self.unlock(lock)
        logger.info("kvtier: loaded %d tokens (device had %d of %d)", got - device_len,
                    device_len, len(key))
        return got - device_len

    def _alloc(self, num_tokens: int) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        slots = allocator.alloc(num_tokens)
        if slots is None:
            allocator.evict_to_free_tokens(self, num_tokens)
            slots = allocator.alloc(num_tokens)
        return None if slots is None else slots.to(torch.int64)

    # ---- background prefetch (SGLang's storage-prefetch hooks) ----

    def is_backuped(self, node_id: Any) -> bool:
        # kvtier keys are rebuilt from token ids, so a prefetch may start from any node.
        return True

    def prefetch_from_storage(self, request: Any, last_host_node_id: Any,
                              new_input_tokens: Any, last_hash: Any = None,
                              prefix_keys: Any = None, matched_prefix_tokens: Any = None,
                              extra_key: Any = None, cache_salt: Any = None,
                              storage_hit_end: Any = None) -> None:
        """A request joined the waiting queue: start loading its chunks in the background."""
        kv = self.kvtier
        if kv is None or self.disable or extra_key is not None or cache_salt \
                or getattr(self.tree_core, "is_eagle", False):
            return
        tokens = np.concatenate([_token_array(matched_prefix_tokens or []),
                                 _token_array(new_input_tokens)])
        kv.start_prefetch(request.rid, tokens)

    def check_prefetch_progress(self, request: Any) -> bool:
        """Whether the waiting request may be admitted now (per `prefetch_policy`)."""
        self._release_finished_stores()
        return True if self.kvtier is None else self.kvtier.prefetch_ready(request.rid)

    def pop_prefetch_loaded_span(self, request: Any) -> tuple[int, int | None]:
        # Loaded chunks reach the pool in match_prefix and count as device hits.
        return 0, None

    def release_aborted_request(self, request: Any) -> None:
        """The request is gone before admission: cancel its prefetch, free what it loaded."""
        if self.kvtier is not None:
            self.kvtier.cancel_prefetch(request.rid)
            logger.info("kvtier: request %s aborted; the tree protects %d tokens",
                        request.rid, self.protected_size())

    def check_hicache_events(self) -> None:
        """Called by the scheduler every step: hand back the locks of finished stores."""
        self._release_finished_stores()

    def has_pending_cache_operations(self) -> bool:
        kv = self.kvtier
        return kv is not None and (kv.pending_prefetches() > 0 or kv.pending_stores() > 0)

    def clear_storage_backend(self) -> bool:
        logger.warning("kvtier: clearing the storage tiers over HTTP is not supported; use "
                       "`kvtier purge`")
        return False

    # ---- store ----

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        self._release_finished_stores()
        super().checkpoint(req, up_to=up_to, **kwargs)
        if self.kvtier is not None and req.finished() and not self._aborted(req):
            self._submit_store(req)

    @staticmethod
    def _aborted(req: Any) -> bool:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        return isinstance(req.finished_reason, FINISH_ABORT)

    def _submit_store(self, req: Any) -> None:
        kv = self.kvtier
        assert kv is not None
        node = req.last_node
        if node is None or self.disable or req.extra_key is not None or req.cache_salt:
            return
        slots = self.path_device_indices(node)
        keyed = kv.engine.keys.num_keyed_tokens(len(slots))
        if keyed == 0:
            return
        tokens = _token_array(req.full_untruncated_fill_ids)[:keyed].copy()
        if len(tokens) < keyed:
            return
        lock = self.lock(node)
        session = getattr(req, "session", None)  # SGLang's session API: pin between turns
        sid = getattr(session, "session_id", None)
        if not kv.submit_store(tokens, slots[:keyed].to(torch.int64), lock, sid):
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

    def evict(self, params: EvictParams) -> Any:
        self._release_finished_stores()
        return super().evict(params)

    def evict_for_alloc(self, params: EvictParams, *args: Any, **kwargs: Any) -> Any:
        self._release_finished_stores()
        return super().evict_for_alloc(params, *args, **kwargs)

    def reset(self) -> None:
        kv = self.kvtier  # None while UnifiedRadixCache.__init__ runs
        if kv is not None:
            # A flush clears the pool: no store may still be reading it. Lower tiers are
            # flushed too, so a flush makes everything stored so far durable.
            for job in kv.wait_all(kv.engine.config.blocking_timeout_secs):
                self.unlock(job.handle)
            kv.flush(kv.engine.config.blocking_timeout_secs)
        super().reset()

    def shutdown(self) -> None:
        if self.kvtier is not None:
            for job in self.kvtier.wait_all(self.kvtier.engine.config.blocking_timeout_secs):
                self.unlock(job.handle)
            self.kvtier.close()
        super().shutdown()
