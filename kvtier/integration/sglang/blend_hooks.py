"""Where kvtier's radix tree hands a finished request to the blender.

SGLang releases every finished request through `release_kv_cache`, which ends in the tree's
`on_release`, whether or not the request's KV went into the tree first. A request kept out of
the tree (`skip_radix_cache_insert`: one that opted out of blending, or a verified one, while
blended KV is in the device tree) is never checkpointed, so `on_release` is the one place that
sees every request finish: the blender then queues the segments it missed for a standalone
prefill and, when verification sampled the request, the check of its segments' records.
"""

from __future__ import annotations

from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvtier.integration.sglang.adapter import SGLangKVTier
from kvtier.integration.sglang.blending import SGLangBlender
from kvtier.integration.sglang.requests import aborted, salt_of, token_array
from kvtier.integration.sglang.sglang_views import ReqView

__all__ = ["BlendReleaseHook"]


class BlendReleaseHook(UnifiedRadixCache):
    """SGLang's unified tree that tells kvtier's blender when a request finished: a base of
    `KVTierRadixCache`, which attaches the engine (`kvtier`) and the blender."""

    kvtier: SGLangKVTier | None = None
    blender: SGLangBlender | None = None

    def on_release(self, req: ReqView, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        kv, blender = self.kvtier, self.blender
        if kv is None or blender is None or not req.finished():
            return  # a retracted request comes back and finishes later
        with kv.budget.timed("on_release", req.rid):
            blender.finished(req.rid, token_array(req.origin_input_ids),
                             salt_of(req.cache_salt), aborted(req),
                             verified=kv.engine.verifies(req.rid))
