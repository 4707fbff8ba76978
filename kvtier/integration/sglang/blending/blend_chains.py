"""Each request's segments and their key chains, found once per request.

A blending server looks at a waiting request's segments at its prefetch and at every match
(SGLang matches a waiting request again at each scheduler step), all on the scheduler thread.
Finding the separators and hashing every segment's chunks costs time linear in the prompt: a
131K-token prompt of 256 segments took tens of milliseconds per pass, several times its prefix
lookup. So both are done once per request and kept until the request finishes; a request whose
tokens or salt changed since gets new ones.

A prompt blends at most `MAX_SEGMENTS` segments, the first ones in prompt order: each blended
segment costs a CPU-tier lookup at every match and a read at admission. The others are computed
like any uncached token (counted as `blend_segments_capped`; logged once per server).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvtier.blend.segments import Segment, find_segments
from kvtier.engine.segments import SegmentStore
from kvtier.keys import KeyChain
from kvtier.metrics import Counters

__all__ = ["MAX_SEGMENTS", "PromptSegments", "SegmentChains", "SegmentHits"]

logger = logging.getLogger(__name__)

MAX_SEGMENTS = 64  # segments blended per prompt; later ones are computed (counted, logged once)
MAX_REQUESTS = 4096  # requests remembered at once; more means requests that never finished


class SegmentHits(NamedTuple):
    """A prompt's segments past its device prefix (`device_len` tokens), up to `end` (the
    tokens a blend computes): those the CPU tier holds (`held`, `cached` tokens of them,
    `chains` their key chains) and those it lacks."""

    end: int
    held: tuple[Segment, ...]
    missed: tuple[Segment, ...]
    cached: int
    chains: tuple[KeyChain, ...] = ()
    device_len: int = 0


class PromptSegments(NamedTuple):
    """A prompt's segments in prompt order (at most the cap), found in all its tokens but the
    last (which SGLang always computes), and the key chain of each."""

    segments: tuple[Segment, ...]
    chains: tuple[KeyChain, ...]


class _Entry(NamedTuple):
    ids: np.ndarray  # the tokens the segments were found in (a changed prompt misses)
    salt: str
    prompt: PromptSegments


class SegmentChains:
    """The per-request cache of `PromptSegments` (scheduler thread only).

    Args:
        store: builds each segment's chain (`SegmentStore.chain`).
        separator: `blend_special_str` as token ids.
        min_tokens: the shortest segment (`blend_min_tokens`).
        counters: where `sglang.blend_segments_capped` is counted (declared by the caller).
        max_segments: the cap per prompt.
    """

    def __init__(self, store: SegmentStore, separator: Sequence[int], min_tokens: int,
                 counters: Counters, max_segments: int = MAX_SEGMENTS):
        if max_segments < 1:
            raise ValueError(f"max_segments must be >= 1, got {max_segments}")
        self._store = store
        self._separator = tuple(separator)
        self._min_tokens = min_tokens
        self._counters = counters
        self.max_segments = max_segments
        self._entries: dict[str, _Entry] = {}
        self._warned = False

    def of(self, rid: str, tokens: np.ndarray, salt: str) -> PromptSegments:
        """The segments of prompt `tokens` (all but its last token) and their chains under
        `salt`, built at the first call about request `rid` and returned again while its
        tokens and salt stay the same. Never mutates `tokens`."""
        ids = np.asarray(tokens[:max(len(tokens) - 1, 0)])
        entry = self._entries.get(rid)
        if entry is not None and entry.salt == salt and np.array_equal(entry.ids, ids):
            return entry.prompt
        prompt = self._build(ids, salt)
        if len(self._entries) >= MAX_REQUESTS:
            self._entries.clear()  # requests that never came back
        # int32 like the chains' own token bytes: a 131K-token prompt keeps 0.5 MB.
        self._entries[rid] = _Entry(ids.astype(np.int32), salt, prompt)
        return prompt

    def forget(self, rid: str | None = None) -> None:
        """Drop request `rid`'s segments (every request's when None)."""
        if rid is None:
            self._entries.clear()
        else:
            self._entries.pop(rid, None)

    def _build(self, ids: np.ndarray, salt: str) -> PromptSegments:
        found = find_segments(ids, self._separator, self._min_tokens)
        kept = found[:self.max_segments]
        if len(found) > len(kept):
            self._counters.inc("sglang.blend_segments_capped", len(found) - len(kept))
            if not self._warned:
                self._warned = True
                logger.warning("kvtier: a prompt holds %d segments; only its first %d are "
                               "blended, the rest are computed (counted in "
                               "kvtier_sglang_blend_segments_capped_total; logged once)",
                               len(found), len(kept))
        chains = tuple(self._store.chain(ids, seg, salt) for seg in kept)
        return PromptSegments(tuple(kept), chains)


def hint_preamble(rid: str, first: Segment, hits: SegmentHits, device_len: int,
                  separator: str) -> bool:
    """Warn (and return True) when the run that starts a prompt (no separator before it)
    missed while later segments hit: a preamble that no separator ends is one segment with
    the first document, which then misses wherever that document stands elsewhere
    (docs/blending.md, "Turning it on"). The blender warns once per server."""
    if first.start != 0 or first.end <= device_len or first in hits.held \
            or first not in hits.missed:
        return False
    logger.warning("kvtier: %s: the %d tokens before the first separator were not found as a "
                   "segment, while %d later segments were. If a preamble (a system prompt, a "
                   "chat template's opening) stands before the first document, end it with the "
                   "separator too (%r): otherwise that document is cached only together with "
                   "the preamble (logged once; docs/blending.md, \"Turning it on\")", rid,
                   first.num_tokens, len(hits.held), separator)
    return True
