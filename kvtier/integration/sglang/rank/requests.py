"""What kvtier reads of an SGLang request: its token ids (copies, never views), its salt,
whether it carries multimodal inputs, whether it was aborted, whether it may blend, and its
lifecycle hints (`sampling_params.custom_params`, `kvtier.engine.hints`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.engine.hints import Hints
from kvtier.integration.sglang.boundary.sglang_views import RadixKeyView, ReqView
from kvtier.metrics import RateLimitedLog

__all__ = ["aborted", "full_ids", "hints_of", "multimodal", "salt_of", "token_array",
           "wants_blend"]

# sampling_params.custom_params keys
REQUEST_SWITCH = "kvtier_blend"  # false opts a request out of blending
RETAIN = "kvtier_retain_s"  # keep the request's prefix in the CPU tier this many seconds
EPHEMERAL = "kvtier_ephemeral_from"  # never store the tokens from this position on

_warn = RateLimitedLog(logging.getLogger(__name__))


def token_array(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """A copy of SGLang's token ids as int64. Never a view: SGLang grows its token arrays in
    place (`array.extend`), which fails while any view of one is alive, and a view handed down
    the stack can outlive the call (an exception's traceback keeps every frame's locals)."""
    return np.array(ids, dtype=np.int64)


def multimodal(req: ReqView) -> bool:
    """Whether a request carries images, audio or video. SGLang puts values derived from each
    item's hash into the token ids in its place, and a client may choose that hash itself
    (`mm_hashes`); keyed fleet-wide and kept for days, a collision of those (made on purpose,
    or by a weak hash) would serve one image's KV for another, and token verification cannot
    see it. So such requests bypass kvtier (the HiCache backend refuses such models)."""
    return getattr(req, "multimodal_inputs", None) is not None


def full_ids(req: ReqView, key: RadixKeyView) -> np.ndarray:
    """The request's whole token sequence: the match key stops before the last prompt token,
    but the chunk holding it is named by all of its tokens (and loads in part)."""
    matched = token_array(key.raw_token_ids())
    full = getattr(req, "full_untruncated_fill_ids", None)
    ids = token_array(full) if full else matched
    if len(ids) < len(matched) or not np.array_equal(ids[:len(matched)], matched):
        return matched  # never expected: trust the key alone
    return ids


def salt_of(cache_salt: str | None) -> str:
    """A request's `cache_salt` as kvtier mixes it into its keys ("" for none)."""
    return "" if cache_salt is None else str(cache_salt)


def aborted(req: ReqView) -> bool:
    """Whether SGLang aborted the request (its KV may be partial)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT)


def _custom_params(req: ReqView) -> dict[str, Any]:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return params if isinstance(params, dict) else {}


def wants_blend(req: ReqView) -> bool:
    """Whether `req` may blend: blending is on unless its `custom_params` say
    `{"kvtier_blend": false}`."""
    return _custom_params(req).get(REQUEST_SWITCH) is not False


def hints_of(req: ReqView) -> Hints | None:
    """The lifecycle hints `req`'s `custom_params` carry (`{"kvtier_retain_s": 30}`,
    `{"kvtier_ephemeral_from": 512}`), or None. A bad one is ignored with a warning naming
    it: a client's typo costs the hint, never the request."""
    params = _custom_params(req)
    if RETAIN not in params and EPHEMERAL not in params:
        return None
    try:
        return Hints(params.get(RETAIN), params.get(EPHEMERAL)).check()
    except ValueError as exc:
        _warn.warning("bad-hint", "kvtier: ignored a request's custom_params %s / %s: %s",
                      RETAIN, EPHEMERAL, exc)
        return None
