"""What the blender knows of one request, from its first match to its end (`SGLangBlender`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kvtier.blend.planner import Choice
from kvtier.engine import Prefetch
from kvtier.integration.sglang.blending.blend_chains import SegmentHits
from kvtier.integration.sglang.rank.request_state import RequestTable

__all__ = ["BlendRequest", "blend_requests"]


@dataclass(slots=True)
class BlendRequest:
    """One request's blend.

    `hits`: its segments at its last match (kept for its end: the missed ones are computed
    alone then); `choice`: blend or compute, made once; `declined`: it may not blend (opted
    out); `waiting`: its prompt and salt, from its prefetch until its segment loads are in
    and its blend job starts; `loads`: those loads; `asked`: whether some tier holds one of
    its segments, asked off the scheduler thread while blends lose (`SGLangBlender.prefetch`).
    """

    hits: SegmentHits | None = None
    choice: Choice | None = None
    declined: bool = False
    waiting: tuple[np.ndarray, str] | None = None
    loads: list[Prefetch] | None = None
    asked: Future[bool] | None = None


def blend_requests() -> RequestTable[BlendRequest]:
    """The blender's table: bounded like the rank's, a request with loads or a question
    running is held."""
    return RequestTable(BlendRequest, lambda r: r.loads is not None or r.asked is not None)
