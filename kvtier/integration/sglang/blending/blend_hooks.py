"""What kvtier's radix tree does for blending (`enable_blending`), apart from its prefix path.

- Match: when the CPU tier holds more of a request's segments than of its prefix, the host
  hit promised is the blend's (`_blend_hit`), unless the blend is measured to lose to the
  full prefill (`SGLangBlender.worth`); a request that must read no blended KV (opted
  out, or verified) matches only up to the first blended slot (`_exact_match`).
- Admission: the blend is computed into the new slots (`_blend_into`), and SGLang is told how
  many of the promised tokens came from the cache (`_report_blend`): SGLang counts a host hit
  whole in `cached_tokens`, while a blend computes every token no segment gave and recomputes
  a share of those that one did.
- Release: SGLang releases every finished request through `release_kv_cache`, which ends in
  the tree's `on_release`, whether or not the request's KV went into the tree first. A request
  kept out of the tree (`skip_radix_cache_insert`) is never checkpointed, so `on_release` is
  the one place that sees every request finish: the blender then queues the segments it
  missed for a standalone prefill and, when verification sampled the request, the check of
  its segments' records.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvtier.integration.sglang.blending.blended_slots import BlendedSlots
from kvtier.integration.sglang.blending.blender import SegmentHits, SGLangBlender
from kvtier.integration.sglang.boundary.sglang_views import (
    MatchPrefixParamsView,
    MatchResultView,
    RadixKeyView,
    ReqView,
)
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from kvtier.integration.sglang.rank.requests import (
    aborted,
    full_ids,
    salt_of,
    token_array,
    wants_blend,
)

__all__ = ["BlendHooks"]

logger = logging.getLogger("kvtier.integration.sglang.rank.radix_cache")  # one logger: one tree


class BlendHooks(UnifiedRadixCache):
    """SGLang's unified tree with kvtier's blending hooks: a base of `KVTierRadixCache`, which
    attaches the engine (`kvtier`) and the blender."""

    kvtier: SGLangKVTier | None = None
    blender: SGLangBlender | None = None
    _blended: BlendedSlots | None = None

    def on_release(self, req: ReqView, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        kv, blender = self.kvtier, self.blender
        if kv is None or blender is None or not req.finished():
            return  # a retracted request comes back and finishes later
        with kv.budget.timed("on_release", req.rid):
            blender.finished(req.rid, token_array(req.origin_input_ids),
                             salt_of(req.cache_salt), aborted(req),
                             verified=kv.engine.verifies(req.rid))

    def _exact_match(self, req: ReqView, params: MatchPrefixParamsView,
                     result: MatchResultView) -> MatchResultView | None:
        """For a request that must read no blended KV (opted out of blending, or verified):
        the device match cut before its first blended slot; None if it reached none. The
        request is kept out of the tree: SGLang's insert would swap its computed KV for the
        tree's blended copy."""
        kv, blender, blended = self.kvtier, self.blender, self._blended
        if blender is not None and not wants_blend(req):
            blender.decline(req.rid)  # SGLang matches a request before its prefetch hook
        if blended is None or blender is None or kv is None or result.device_prefix_len == 0 \
                or (wants_blend(req) and not kv.engine.verifies(req.rid)):
            return None
        slots = self.path_device_indices(result.last_device_node)[:result.device_prefix_len]
        cut = blended.exact_prefix(slots)
        if cut >= result.device_prefix_len:
            return None
        page = blender.page_size  # a blend starts and ends on page boundaries
        if not req.skip_radix_cache_insert:  # SGLang may match a waiting request again
            logger.info("kvtier: %s read no blended KV: computed after %d tokens", req.rid, cut)
        req.skip_radix_cache_insert = True
        return super().match_prefix(MatchPrefixParams(key=params.key[:cut - cut % page],
                                                      req=req))

    def _blend_hit(self, req: ReqView, key: RadixKeyView, device_len: int,
                   hit: int) -> SegmentHits | None:
        """The request's held segments when a blend of them gives more tokens than the
        prefix load (`hit`) does (then promised as the host hit), else None."""
        blender, kv = self.blender, self.kvtier
        if blender is None or kv is None or kv.verifying(req.rid) or not wants_blend(req):
            return None
        hits = blender.look(req.rid, full_ids(req, key), device_len, salt_of(key.cache_salt))
        if hits.cached <= hit or hits.end <= device_len + hit \
                or not blender.worth(req.rid, hits.end, device_len):
            return None
        return hits

    def _blend_into(self, rid: str, tokens: np.ndarray, hits: SegmentHits, device_len: int,
                    prefix: torch.Tensor, slots: torch.Tensor, salt: str) -> int | None:
        """Blend tokens [device_len, hits.end) into `slots`: how many kept their cached KV
        (`SGLangBlender.fill`), or None (nothing written: the request is computed)."""
        kv, blender = self.kvtier, self.blender
        assert kv is not None and blender is not None
        try:
            return blender.fill(rid, tokens, hits, device_len, prefix, slots, salt)
        except Exception:  # a cache never takes serving down: the request is computed
            kv.counters.inc("sglang.blend_failures")
            logger.exception("kvtier: blending %s failed; computing it instead", rid)
            return None

    @staticmethod
    def _report_blend(req: ReqView, blended: int, kept: int) -> int:
        """Tell SGLang that of the `blended` tokens its host hit promised, only `kept` came
        from the cache; returns the tokens the blend computed. SGLang counts
        `prefix_len - already_computed` as the request's `cached_tokens` when its prefill is
        prepared: the tokens the blend computed are computed already. Its breakdown
        (`cached_tokens_details`: device, host) is set here too, once, as SGLang sets it."""
        req.already_computed += blended - kept
        req.cached_tokens_device = req.prefix_len
        req.cached_tokens_host = kept
        req._cache_breakdown_computed = True
        return blended - kept

    @staticmethod
    def _unreport_blend(req: ReqView, computed: int) -> None:
        """The request is matched again before its prefill ran (`_report_blend` undone): what
        its next admission finds is counted afresh."""
        req.already_computed -= computed
        req._cache_breakdown_computed = False
