"""Segment records checked against SGLang's own KV of the segment, not only kvtier's.

A segment record is the KV of the segment's tokens computed alone, at position 0, and the
background check of a sampled request's segments (`blend_worker`) computes it again the same
way: by kvtier's own forward (`kvtier.blend.forward.prefill`), or at TP 1 on SGLang's CPU engine
by SGLang's model on kvtier's thread (`rows_forward`). A bug there that computes the same wrong
KV every time would pass, served by every blend. SGLang's extend computes a segment alone
exactly where a prompt starts with it: the KV of a prompt's first tokens depends on nothing
else, so the pool's KV of a prompt's first segment is SGLang's KV of that segment at position 0,
what its record should hold.

So, on the store thread, before a verified request's own comparison releases its slots, its
first segment (when it starts the prompt and some tier holds it) is gathered from the pool and
compared with every tier's records of it (`SegmentStore.verify`: the measure and tolerance of
prefix verification, the per-tier counts, the removal). A record that differs leaves its tier,
so no blend reads it again; it is counted (`blend_segments_engine_mismatched`) and logged.

Nothing is stored in its place: the pool's prefix may have been loaded from prefix records
rather than computed, so it is good enough to accuse a record (a removal costs a recompute) but
not to vouch for one. The next prompt that misses the segment stores it again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.blend.segments import find_segments
from kvtier.engine.segments import SegmentStore
from kvtier.engine.verify import Verdict
from kvtier.metrics import Counters, RateLimitedLog

__all__ = ["ENGINE_CHECK_COUNTERS", "EngineSegmentCheck"]

logger = logging.getLogger(__name__)
_warn = RateLimitedLog(logger)

ENGINE_CHECK_COUNTERS = ("blend_segments_engine_checked", "blend_segments_engine_mismatched")


class EngineSegmentCheck:
    """`check(...)`: compare the records of a verified request's first segment with the pool's
    KV of it. Called on the store thread only (it reads every tier and copies from the pool).

    Args:
        store: the segment store.
        pool: the KV pool's per-layer K and V buffers (`[slots, kv_heads, head_dim]`).
        separator: `blend_special_str` as token ids; `min_tokens`: the shortest segment.
        counters: where `ENGINE_CHECK_COUNTERS` are counted (`sglang.` names).
        computed_by: what computes the segments' records and the background check of them
            (named in the mismatch warning: a record that both passed points at it).
    """

    def __init__(self, store: SegmentStore,
                 pool: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
                 separator: Sequence[int], min_tokens: int, counters: Counters,
                 computed_by: str = "kvtier's forward (kvtier/blend/forward.py)"):
        self.store = store
        self.computed_by = computed_by
        self._k, self._v = pool
        self._separator = tuple(separator)
        self._min_tokens = min_tokens
        self.counters = counters

    def check(self, token_ids: np.ndarray, slots: torch.Tensor, salt: str,
              prompt_len: int | None = None,
              ready: torch.cuda.Event | None = None) -> list[Verdict] | None:
        """Compare every tier's records of the first segment of `token_ids` (found in the
        prompt, its first `prompt_len` tokens, as a blend finds it) with the KV the pool
        holds for it in `slots`, which must still be the request's; removes what differs.
        `ready`: the event after the forward that wrote them (GPU).

        Returns:
            A verdict per record compared, or None: no segment starts the prompt, or no tier
            holds it.
        """
        n = (len(token_ids) if prompt_len is None else prompt_len) - 1
        segments = find_segments(token_ids[:n], self._separator, self._min_tokens)
        if not segments or segments[0].start != 0:
            return None
        segment = segments[0]
        chain = self.store.chain(token_ids, segment, salt)
        if not self.store.lookup(chain):
            return None
        if ready is not None:
            ready.synchronize()
        at = slots[:segment.end].to(self._k[0].device, torch.int64)
        kv = torch.stack([torch.stack([buf[at].flatten(1) for buf in bufs])
                          for bufs in (self._k, self._v)])  # [2, layers, tokens, kv_width]
        verdicts = self.store.verify(chain, kv)
        self.counters.inc("sglang.blend_segments_engine_checked")
        wrong = [v for v in verdicts if not v.matched]
        logger.info("kvtier: checked the %d-token segment that starts a verified prompt "
                    "against SGLang's KV of it: %d records in %s, %d differed (largest "
                    "relative error %.3g)", segment.num_tokens, len(verdicts),
                    sorted({v.tier for v in verdicts}), len(wrong),
                    max((v.error for v in verdicts), default=0.0))
        if wrong:
            self.counters.inc("sglang.blend_segments_engine_mismatched")
            first = wrong[0]
            _warn.warning("segment-engine", "kvtier: verification MISMATCH: the segment that "
                          "starts a verified prompt (%d tokens, first key %s...) differs from "
                          "SGLang's own KV of it in %d records (tiers %s; first: tokens %d-%d "
                          "from layer %s on, relative error %.3g); removed, so no blend reads "
                          "them. Records that every background check passed point at what "
                          "computed them, %s: see docs/blending.md",
                          segment.num_tokens, chain[0].key[:16] if len(chain) else "-",
                          len(wrong), sorted({v.tier for v in wrong}), first.key.start,
                          first.key.end, first.layer, first.error, self.computed_by)
        return verdicts
