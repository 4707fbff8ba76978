"""Reuse at any position (CacheBlend-style blending).

A segment of a prompt (a document, a tool output) is cached on its own, computed as if it were a
whole prompt starting at position 0, under a key of its own tokens: the same document behind
another question, at another offset or in another order, finds it. Its KV cannot be used as is:
its keys carry the rotation of the positions it was computed at, and its tokens never attended
to what now precedes them. Blending fixes both: the cached keys are re-rotated to their new
positions (`rope`), then a forward pass computes every token in the first layers, picks at a
check layer the share of cached tokens whose KV deviates most from a fresh computation, and
computes only those (and every token that was not cached) in the later layers (`forward`).

Modules: `segments` (where segments are, what they are keyed by), `store` (a segment's KV in
the tiers), `assemble` (a prompt's known KV from its cached segments), `rope` (rotary tables
and re-rotation), `forward` (a Llama-family forward over plain weight tensors, in full or
blended), `weights` (those tensors from a Hugging Face directory), `verify` (segment records
compared with the segment computed alone again), `planner` (blend or compute: a blend only
while it is measured to beat the full prefill). Nothing here imports SGLang; it is served by
`kvtier.integration.sglang.blending.blender` (docs/blending.md).

Not yet as the layers would have it: the engine hands out a `SegmentStore` over its own storage
manager (`CacheEngine.segments`), and `store` and `verify` then work on that manager, `verify`
reading each tier's records below its API; the engine wing should hold a segment's storage and
this package only compute.
"""

from __future__ import annotations

__all__: list[str] = []
