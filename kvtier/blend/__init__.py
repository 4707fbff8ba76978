"""Reuse at any position (CacheBlend-style blending).

A segment of a prompt (a document, a tool output) is cached on its own, computed as if it were a
whole prompt starting at position 0, under a key of its own tokens: the same document behind
another question, at another offset or in another order, finds it. Its KV cannot be used as is:
its keys carry the rotation of the positions it was computed at, and its tokens never attended
to what now precedes them. Blending fixes both: the cached keys are re-rotated to their new
positions (`rope`), then a forward pass computes every token in the first layers, picks at a
check layer the share of cached tokens whose KV deviates most from a fresh computation, and
computes only those (and every token that was not cached) in the later layers (`forward`).

Modules: `segments` (where segments are), `assemble` (a prompt's known KV from its cached
segments), `rope` (rotary tables and re-rotation), `forward` (a Llama-family forward over plain
weight tensors, in full or blended), `weights` (those tensors from a Hugging Face directory),
`planner` (blend or compute: a blend only while it is measured to beat the full prefill).
Nothing here imports SGLang; it is served by `kvtier.integration.sglang.blending.blender`
(docs/blending.md).

This package computes; storage is the engine wing's: a segment's KV goes into and comes out of
the tiers through `CacheEngine.segments` (`kvtier.engine.segments.SegmentStore`, with the
segments' keys), and its records are checked against a fresh computation there
(`kvtier.engine.segment_checks`). Nothing here imports `kvtier.storage`.
"""

from __future__ import annotations

__all__: list[str] = []
