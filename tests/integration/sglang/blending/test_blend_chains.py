"""A request's segments and their keys are found once (at its prefetch or first match), not at
every match on SGLang's scheduler thread; a prompt blends at most `MAX_SEGMENTS` of them. The
blender is driven as the radix cache drives it, without a server."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kvtier.blend.assemble import assemble
from kvtier.blend.forward import blend, prefill
from kvtier.blend.segments import Segment, find_segments
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.engine.segments import SegmentStore
from kvtier.integration.sglang.blending.blend_chains import MAX_SEGMENTS
from kvtier.integration.sglang.blending.blender import BLEND_COUNTERS, SGLangBlender
from kvtier.memory import KVLayout
from kvtier.metrics import Counters
from tests.blend.conftest import tiny_llama

SEP = 100  # tiny_llama's last token id: the separator
DOC = 24  # tokens per document (blend_min_tokens is 16)


@pytest.fixture
def blender() -> Iterator[SGLangBlender]:
    w = tiny_llama()
    layout = KVLayout.mha(num_layers=w.num_layers, num_kv_heads=w.num_kv_heads,
                          head_dim=w.head_dim, dtype=torch.float32)
    shape = (256, w.num_kv_heads, w.head_dim)
    k = [torch.zeros(shape) for _ in range(w.num_layers)]
    v = [torch.zeros(shape) for _ in range(w.num_layers)]
    cfg = Config(chunk_size=16, max_local_cpu_size=0.05, save_tails=True, enable_blending=True,
                 blend_min_tokens=16)
    with CacheEngine(cfg, model_name="m", layout=layout,
                     connector=SGLangMHAConnector(k, v)) as engine:
        counters = Counters(*(f"sglang.{name}" for name in BLEND_COUNTERS))
        b = SGLangBlender(w, engine.segments(), cfg.blend, [SEP], (k, v), 4, counters)
        yield b
        b.close()


def _prompt(docs: int, seed: int = 0) -> np.ndarray:
    """A preamble, `docs` documents each ended by the separator, then a question."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(1, SEP, 5), [SEP]]
    for _ in range(docs):
        parts += [rng.integers(1, SEP, DOC), [SEP]]
    return np.concatenate([*parts, rng.integers(1, SEP, 7)]).astype(np.int64)


def _counting(store: SegmentStore, monkeypatch: pytest.MonkeyPatch) -> list[Segment]:
    """The segments `store.chain` is asked to key from now on."""
    calls: list[Segment] = []
    original: Callable[..., object] = store.chain

    def chain(tokens: object, segment: Segment, salt: str = "") -> object:
        calls.append(segment)
        return original(tokens, segment, salt)

    monkeypatch.setattr(store, "chain", chain)
    return calls


def test_a_request_s_segment_keys_are_built_once_over_its_matches(
        blender: SGLangBlender, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(blender.store, monkeypatch)
    tokens = _prompt(4)
    blender.prefetch("r", tokens, "")  # joined the waiting queue
    assert len(calls) == 4
    first = blender.look("r", tokens, 0, "")
    for device_len in (0, 0, 32):  # SGLang matches a waiting request at every step
        blender.look("r", tokens, device_len, "")
    assert len(calls) == 4 and len(first.missed) == 4 and not first.held
    blender.look("r", tokens, 0, "salt")  # another salt: other keys
    assert len(calls) == 8
    changed = tokens.copy()
    changed[10] = changed[10] % 99 + 1  # a changed prompt: its segments are keyed again
    blender.look("r", changed, 0, "salt")
    assert len(calls) == 12
    blender.look("other", tokens, 0, "")  # another request: its own
    assert len(calls) == 16
    blender.finished("r", changed, "salt", aborted=True)  # forgotten once it finished
    blender.look("r", changed, 0, "salt")
    assert len(calls) == 20


def test_a_prompt_blends_at_most_max_segments(blender: SGLangBlender,
                                              caplog: pytest.LogCaptureFixture) -> None:
    many = _prompt(MAX_SEGMENTS + 3)
    assert len(find_segments(many.tolist(), [SEP], 16)) == MAX_SEGMENTS + 3
    with caplog.at_level(logging.WARNING, "kvtier"):
        hits = blender.look("r", many, 0, "")
        blender.look("r", many, 0, "")  # the same request again: counted once
        blender.look("s", many, 0, "")  # another such request: counted, not logged again
    assert len(hits.held) + len(hits.missed) == MAX_SEGMENTS
    assert hits.missed == tuple(find_segments(many.tolist(), [SEP], 16)[:MAX_SEGMENTS])
    assert blender.counters.snapshot()["sglang.blend_segments_capped"] == 6
    warnings = [r for r in caplog.records if "segments" in r.getMessage()]
    assert len(warnings) == 1 and "first 64 are blended" in warnings[0].getMessage()


@pytest.mark.parametrize("device_len", [0, 30, 64])
@pytest.mark.parametrize("cut", [0, 1, 3])
def test_a_prompt_s_segments_and_hits_are_those_of_its_tokens(
        blender: SGLangBlender, device_len: int, cut: int) -> None:
    """What `look` finds is what `find_segments` finds in the tokens a blend computes (all but
    the last, whole pages), held where a stored segment is; the cache changes nothing."""
    tokens = _prompt(4, seed=1)
    sep_at = [i for i, t in enumerate(tokens) if t == SEP]
    # Cut the question so that the last separator ends at, or just past, the blend's end.
    tokens = tokens[:sep_at[-1] + 1 + cut]
    n = len(tokens) - 1
    end = n - n % blender.page_size
    segments = find_segments(tokens[:end].tolist(), [SEP], 16)
    stored = segments[1]  # the second document is held, alone at position 0
    ids = torch.from_numpy(tokens[stored.start:stored.end])
    blender.store.save(blender.store.chain(ids, Segment(0, len(ids))),
                       prefill(blender.w, ids, logits=False).kv)
    for _ in range(2):
        hits = blender.look("r", tokens, device_len, "")
        past = [s for s in segments if s.end > device_len]
        assert hits.end == end
        assert hits.held == tuple(s for s in past if s == stored)
        assert hits.missed == tuple(s for s in past if s != stored)
        assert hits.cached == max(0, stored.end - max(stored.start, device_len))


def test_a_blend_over_the_request_s_chains_writes_what_it_wrote_before(
        blender: SGLangBlender) -> None:
    tokens = _prompt(4, seed=2)
    w, store = blender.w, blender.store
    for seg in find_segments(tokens.tolist(), [SEP], 16)[::2]:  # two of the four are held
        ids = torch.from_numpy(tokens[seg.start:seg.end])
        store.save(store.chain(ids, Segment(0, len(ids))), prefill(w, ids, logits=False).kv)
    hits = blender.look("r", tokens, 0, "")
    assert len(hits.held) == 2
    slots = torch.arange(hits.end)
    kept = blender.fill("r", tokens, hits, 0, slots[:0], slots, "")
    # What SGLang is told came from the cache: the held tokens less those computed past the
    # check layer (the share recomputed, and each segment's first token).
    counts = blender.counters.snapshot()
    assert kept == counts["sglang.blend_tokens_loaded"] - \
        counts["sglang.blend_tokens_recomputed"] - 2 > 0
    assert counts["sglang.blend_tokens_loaded"] == 2 * DOC
    # Before: each held segment keyed again from its tokens at admission.
    known = assemble(store, w.rope, tokens[:hits.end].tolist(), hits.held,
                     num_layers=w.num_layers, num_kv_heads=w.num_kv_heads,
                     head_dim=w.head_dim, dtype=torch.float32)
    want = blend(w, torch.from_numpy(tokens[:hits.end]), known.kv, known.cached, blender.plan,
                 must=known.must, logits=False).kv
    for layer in range(w.num_layers):
        got = blender.pool_k[layer][slots].reshape(hits.end, -1)
        assert torch.equal(got, want[0, layer])


def _store_alone(blender: SGLangBlender, tokens: np.ndarray, segment: Segment) -> None:
    ids = torch.from_numpy(tokens[segment.start:segment.end])
    blender.store.save(blender.store.chain(ids, Segment(0, len(ids))),
                       prefill(blender.w, ids, logits=False).kv)


def test_a_reordered_prompt_with_a_separated_preamble_finds_every_document(
        blender: SGLangBlender, caplog: pytest.LogCaptureFixture) -> None:
    first = _prompt(3, seed=3)
    for seg in find_segments(first.tolist(), [SEP], 16):
        _store_alone(blender, first, seg)
    sep_at = [i for i, t in enumerate(first) if t == SEP]
    preamble, docs = first[:sep_at[0] + 1], [first[a + 1:b + 1] for a, b in
                                              zip(sep_at, sep_at[1:])]
    reordered = np.concatenate([preamble, docs[2], docs[0], docs[1], first[sep_at[-1] + 1:]])
    with caplog.at_level(logging.WARNING, "kvtier"):
        hits = blender.look("r", reordered, 0, "")
    assert len(hits.held) == 3 and not hits.missed and hits.cached == 3 * DOC
    assert not [r for r in caplog.records if "preamble" in r.getMessage()]


def test_a_preamble_without_a_separator_is_named_once(
        blender: SGLangBlender, caplog: pytest.LogCaptureFixture) -> None:
    """A preamble that no separator ends makes one segment with the first document, which a
    reorder then misses: the log says how to separate it (once per server)."""
    tokens = _prompt(3, seed=4)
    joined = np.delete(tokens, int(np.flatnonzero(tokens == SEP)[0]))  # preamble + document
    segments = find_segments(joined.tolist(), [SEP], 16)
    assert segments[0].start == 0 and segments[0].num_tokens == 5 + DOC
    _store_alone(blender, joined, segments[1])
    with caplog.at_level(logging.WARNING, "kvtier"):
        hits = blender.look("r", joined, 0, "")
        blender.look("s", joined, 0, "")
    assert hits.held == (segments[1],) and segments[0] in hits.missed
    hints = [r.getMessage() for r in caplog.records if "preamble" in r.getMessage()]
    assert len(hints) == 1 and "end it with the separator too" in hints[0], hints
    assert f"the {5 + DOC} tokens before the first separator" in hints[0]
