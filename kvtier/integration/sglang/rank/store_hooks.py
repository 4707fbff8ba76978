"""The store side of kvtier's radix tree: a finished request's prefix is locked in the tree and
queued for a background store (`adapter.SGLangKVTier.submit_store`); the lock is released on the
scheduler thread at the next tree call after the store has read the slots."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvtier.integration.sglang.blending.blended_slots import BlendedSlots
from kvtier.integration.sglang.boundary.sglang_views import Opaque, ReqView
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from kvtier.integration.sglang.rank.requests import hints_of, multimodal, salt_of, token_array

__all__ = ["StoreHooks"]


class StoreHooks(UnifiedRadixCache):
    """SGLang's unified tree that stores what its finished requests computed: a base of
    `KVTierRadixCache`, which attaches the engine (`kvtier`)."""

    kvtier: SGLangKVTier | None = None
    _blended: BlendedSlots | None = None
    disable: bool

    def checkpoint(self, req: ReqView, *, up_to: int, **kwargs: Opaque) -> None:
        kv = self.kvtier
        if kv is None:
            return super().checkpoint(req, up_to=up_to, **kwargs)
        with kv.budget.timed("checkpoint", req.rid):
            self._release_finished_stores()
            state = kv.requests.get(req.rid)
            if state is not None:
                state.loaded = None  # its prefill ran: the load was used
            super().checkpoint(req, up_to=up_to, **kwargs)
            if req.finished():
                # An aborted request too (a client gone, a server's stop): what it prefilled
                # is exact KV the tree now holds (SGLang inserts only the committed tokens).
                self._submit_store(req)
                kv.requests.forget(req.rid)  # the one place a finished request is forgotten

    def _submit_store(self, req: ReqView) -> None:
        kv = self.kvtier
        assert kv is not None
        node = req.last_node
        if node is None or self.disable or req.extra_key is not None or multimodal(req):
            return
        slots = self.path_device_indices(node)
        if self._blended is not None:  # stop before blended KV (it is approximate)
            slots = slots[:self._blended.exact_prefix(slots)]
        keyed = kv.engine.keys.num_keyed_tokens(len(slots))
        if keyed == 0:
            return
        tokens = token_array(req.full_untruncated_fill_ids)[:keyed]
        if len(tokens) < keyed:
            return
        lock = self.lock(node)
        session = getattr(req, "session", None)  # SGLang's session API: pin between turns
        sid = getattr(session, "session_id", None)
        if not kv.submit_store(tokens, slots[:keyed].to(torch.int64), lock, sid,
                               salt_of(req.cache_salt), len(req.origin_input_ids), req.rid,
                               hints_of(req)):
            self.unlock(lock)

    def _release_finished_stores(self) -> None:
        if self.kvtier is not None:
            for job in self.kvtier.poll_done():
                self.unlock(job.handle)

    def release_session(self, session_id: str) -> None:
        super().release_session(session_id)
        if self.kvtier is not None:
            self.kvtier.release_session(session_id)
