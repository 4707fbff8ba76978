"""From tiers to blended KV: segments stored alone are read back where they now stand, keys
re-rotated there; blending over them with every token recomputed is exactly a full prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.blend.assemble import assemble
from kvtier.blend.forward import BlendPlan, LlamaWeights, blend, prefill
from kvtier.blend.segments import Segment, find_segments
from kvtier.config import Config
from kvtier.engine.segments import SegmentStore
from kvtier.keys import KeyBuilder
from kvtier.memory import KVLayout
from kvtier.storage import StorageManager

SEP = [100]


def _store(llama: LlamaWeights, tmp_path: Path) -> tuple[SegmentStore, StorageManager]:
    layout = KVLayout.mha(num_layers=llama.num_layers, num_kv_heads=llama.num_kv_heads,
                          head_dim=llama.head_dim, dtype=torch.float32)
    storage = StorageManager(Config(chunk_size=16, max_local_cpu_size=0.016, save_tails=True),
                             layout)
    keys = KeyBuilder(model="m", fingerprint=layout.fingerprint(16), chunk_size=16, tails=True)
    return SegmentStore(storage, keys, layout), storage


def _kw(llama: LlamaWeights) -> dict:
    return {"num_layers": llama.num_layers, "num_kv_heads": llama.num_kv_heads,
            "head_dim": llama.head_dim, "dtype": torch.float32}


def test_segments_land_rerotated_where_they_stand(llama: LlamaWeights, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    doc_a, doc_b = (torch.randint(0, 100, (n,), generator=g).tolist() for n in (13, 20))
    store, storage = _store(llama, tmp_path)
    for doc in (doc_a, doc_b):  # stored alone, as a first request would
        chain = store.chain(doc + SEP, find_segments(doc + SEP, SEP)[0])
        assert store.save(chain, prefill(llama, torch.tensor(doc), logits=False).kv) == len(doc)
    prompt = [1, 2, 3] + SEP + doc_b + SEP + doc_a + SEP + [4, 5]
    segs = find_segments(prompt, SEP)
    got = assemble(store, llama.rope, prompt, segs, **_kw(llama))
    assert got.segments_hit == 2  # [1, 2, 3] was never stored
    assert got.cached.nonzero().squeeze(1).tolist() == list(range(4, 24)) + list(range(25, 38))
    assert got.must.nonzero().squeeze(1).tolist() == [4, 25]  # each segment's first token
    # doc_a's rows hold its standalone KV with keys moved from positions 0.. to 25..
    alone = prefill(llama, torch.tensor(doc_a), logits=False).kv
    for layer in range(llama.num_layers):
        keys = alone[0, layer].reshape(13, llama.num_kv_heads, -1)
        want = llama.rope.rerotate(keys, 25).reshape(13, -1)
        assert torch.allclose(got.kv[0, layer, 25:38], want, atol=1e-6)
    assert torch.equal(got.kv[1, :, 25:38], alone[1])

    toks = torch.tensor(prompt)
    full = prefill(llama, toks)
    everything = blend(llama, toks, got.kv, got.cached, BlendPlan.one(1.0), must=got.must)
    assert torch.allclose(everything.kv, full.kv, atol=1e-5)
    storage.close()


def test_refusals(llama: LlamaWeights, tmp_path: Path) -> None:
    store, storage = _store(llama, tmp_path)
    with pytest.raises(ValueError, match="sink_tokens"):
        assemble(store, llama.rope, [1, 2], [], sink_tokens=-1, **_kw(llama))
    with pytest.raises(ValueError, match="outside"):
        assemble(store, llama.rope, [1, 2], [Segment(1, 5)], **_kw(llama))
    storage.close()
