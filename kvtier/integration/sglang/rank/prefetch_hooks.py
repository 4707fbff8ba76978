"""SGLang's storage-prefetch hooks and idle checks, as kvtier's radix tree answers them.

A request that joins the waiting queue starts a background load of its chunks from disk or
Redis into kvtier's CPU tier (`prefetch_from_storage`); the scheduler keeps it waiting while
`check_prefetch_progress` says so (per `prefetch_policy`) and runs the other requests
meanwhile. The idle checks hand back the tree locks of finished stores.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvtier.integration.sglang.blending.blender import SGLangBlender
from kvtier.integration.sglang.boundary.sglang_views import Opaque, ReqView, TreeCoreView
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from kvtier.integration.sglang.rank.requests import multimodal, salt_of, token_array

__all__ = ["StoragePrefetchHooks"]

logger = logging.getLogger("kvtier.integration.sglang.rank.radix_cache")  # one logger: one tree


class StoragePrefetchHooks(UnifiedRadixCache):
    """SGLang's unified tree with kvtier's storage-prefetch hooks and idle checks: the base of
    `KVTierRadixCache`, which attaches the engine (`kvtier`) and the blender."""

    kvtier: SGLangKVTier | None = None
    blender: SGLangBlender | None = None
    disable: bool
    tree_core: TreeCoreView

    def _unlock_stored(self, kv: SGLangKVTier) -> None:
        """Hand back the tree locks of the stores that have read their slots."""
        for job in kv.poll_done():
            self.unlock(job.handle)

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
                or getattr(self.tree_core, "is_eagle", False) or multimodal(request):
            return
        with kv.budget.timed("prefetch_from_storage", request.rid):
            tokens = np.concatenate([token_array(matched_prefix_tokens or []),
                                     token_array(new_input_tokens)])
            kv.start_prefetch(request.rid, tokens, salt_of(cache_salt))
            # `request` is SGLang's handle (no options): an opted-out request was declined
            # at its match, which SGLang runs before this hook
            if self.blender is not None and not kv.engine.verifies(request.rid):
                self.blender.prefetch(request.rid, tokens, salt_of(cache_salt))

    def check_prefetch_progress(self, request: ReqView) -> bool:
        """Whether the waiting request may be admitted now (per `prefetch_policy`)."""
        kv = self.kvtier
        if kv is None:
            return True
        with kv.budget.timed("check_prefetch_progress", request.rid):
            self._unlock_stored(kv)
            return kv.prefetch_ready(request.rid) and (
                self.blender is None or self.blender.prefetch_ready(request.rid))

    def pop_prefetch_loaded_span(self, request: ReqView) -> tuple[int, int | None]:
        # Prefetched chunks reach the pool through init_load_back, as host hits.
        return 0, None

    def check_hicache_events(self) -> None:
        """Called by the scheduler every step: hand back the locks of finished stores."""
        kv = self.kvtier
        if kv is not None and kv.pending_stores():  # most steps have none: no timing either
            with kv.budget.timed("check_hicache_events"):
                self._unlock_stored(kv)

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
