from __future__ import annotations

import pytest
import torch

from kvtier.blend.segments import Segment, find_segments, segment_chain
from kvtier.keys import KeyBuilder

SEP = [7, 8]


def test_segments_are_the_runs_a_separator_ends() -> None:
    toks = [1, 2, 7, 8, 3, 4, 5, 7, 8, 6, 9]
    assert find_segments(toks, SEP) == [Segment(0, 2), Segment(4, 7)]
    assert find_segments(torch.tensor(toks), SEP) == [Segment(0, 2), Segment(4, 7)]
    # a lone 7 is content; back-to-back separators make no empty segment
    assert find_segments([7, 1, 7, 8, 7, 8, 2, 7, 8], SEP) == [Segment(0, 2), Segment(6, 7)]
    assert find_segments([1, 2, 3], SEP) == []
    assert find_segments([1, 7, 8, 2, 3, 4, 7, 8], SEP, min_tokens=2) == [Segment(3, 6)]


def test_refusals() -> None:
    with pytest.raises(ValueError, match="separator"):
        find_segments([1], [])
    with pytest.raises(ValueError, match="min_tokens"):
        find_segments([1], SEP, min_tokens=0)


def _builder(model: str = "m", **kw: object) -> KeyBuilder:
    return KeyBuilder(model=model, fingerprint="f", chunk_size=4, tails=True, **kw)  # type: ignore[arg-type]


def test_segment_keys_ignore_position_and_order() -> None:
    doc_a, doc_b = [11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25]
    one = doc_a + SEP + doc_b + SEP + [99]
    two = [5, 5, 5] + SEP + doc_b + SEP + doc_a + SEP + [98, 97]
    b = _builder()
    a1, b1 = (segment_chain(b, one, s) for s in find_segments(one, SEP))
    b2, a2 = (segment_chain(b, two, s) for s in find_segments(two, SEP)[1:])
    assert [k.key for k in a1] == [k.key for k in a2] and len(a1) == 1
    assert [k.key for k in a1.tails(1)] == [k.key for k in a2.tails(1)]
    assert [k.key for k in b1] == [k.key for k in b2]
    assert a1[0].key != b1[0].key


def test_segment_keys_are_not_prefix_keys_and_follow_identity() -> None:
    doc = [11, 12, 13, 14]
    b = _builder()
    seg = segment_chain(b, doc + SEP, Segment(0, 4))[0].key
    assert seg != b.keys(doc)[0].key  # never read as a prefix's KV
    assert seg != segment_chain(b, doc, Segment(0, 4), salt="tenant")[0].key
    assert seg != segment_chain(_builder("other"), doc, Segment(0, 4))[0].key
    assert seg.startswith(b.prefix)  # same namespace, layout, rank: ls and purge see it
