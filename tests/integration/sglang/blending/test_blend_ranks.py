"""Blending on a tensor-parallel server (`blend_ranks`): two ranks, each a blender over its own
KV heads, driven in step on two threads whose all-reduce is the group's (a barrier), against
one blender of the whole model. The real server at --tp 2: test_sglang_blending.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.blend.forward import LayerWeights, LlamaWeights, prefill
from kvtier.blend.segments import Segment, find_segments
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.blending import in_forward
from kvtier.integration.sglang.blending.blend_jobs import compute
from kvtier.integration.sglang.blending.blend_ranks import Ranks, gather_weights, rows_to_come
from kvtier.integration.sglang.blending.blender import BLEND_COUNTERS, SGLangBlender
from kvtier.memory import KVLayout
from kvtier.metrics import Counters
from tests.blend.conftest import tiny_llama
from tests.integration.sglang.blending.test_blend_jobs import SEP, _prompt

TP = 2


class Group:
    """An all-reduce over `size` threads, each calling with its own tensor in step."""

    def __init__(self, size: int) -> None:
        self._parts: list[torch.Tensor | None] = [None] * size
        self._barrier = threading.Barrier(size, timeout=60)  # a bound on a hang

    def reduce_for(self, rank: int) -> Callable[[torch.Tensor, str], None]:
        def reduce(t: torch.Tensor, op: str) -> None:
            self._parts[rank] = t.clone()
            self._barrier.wait()
            stacked = torch.stack([p for p in self._parts if p is not None])
            out = stacked.min(0).values if op == "min" else stacked.sum(0)
            self._barrier.wait()  # every rank read the parts before any writes again
            t.copy_(out)
        return reduce


def _in_step(*calls: Callable[[], Any]) -> list[Any]:
    """Run one call per rank, each on its own thread (their collectives meet)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=120) for f in [pool.submit(c) for c in calls]]


def _shard(w: LlamaWeights, rank: int, vocab_rows: int) -> LlamaWeights:
    """Rank `rank`'s shard of `w` as SGLang's tensor-parallel layers hold it."""
    d = w.head_dim
    hq, hk = w.num_heads // TP, w.num_kv_heads // TP

    def part(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(TP, dim=dim)[rank]

    layers = []
    for lw in w.layers:
        q, k, v = lw.qkv.split([w.num_heads * d, w.kv_width, w.kv_width])
        gate, up = lw.gate_up.chunk(2)
        layers.append(LayerWeights(
            lw.ln_in, torch.cat([part(q, 0), part(k, 0), part(v, 0)]), part(lw.o, 1),
            lw.ln_post, torch.cat([part(gate, 0), part(up, 0)]), part(lw.down, 1)))
    padded = torch.zeros(vocab_rows * TP, w.embed.shape[1])
    padded[:w.embed.shape[0]] = w.embed
    return LlamaWeights(padded[rank * vocab_rows:(rank + 1) * vocab_rows], tuple(layers),
                        w.norm, w.lm_head, hq, hk, d, w.eps, w.rope)


def test_the_whole_model_is_gathered_from_the_ranks_shards() -> None:
    w = tiny_llama()
    group = Group(TP)
    vocab = w.embed.shape[0]
    got = _in_step(*(lambda r=r: gather_weights(_shard(w, r, 51), Ranks(r, TP, group.reduce_for(r)),
                                                 vocab) for r in range(TP)))
    for whole in got:
        assert (whole.num_heads, whole.num_kv_heads) == (w.num_heads, w.num_kv_heads)
        assert torch.equal(whole.embed[:vocab], w.embed)
        for a, b in zip(whole.layers, w.layers, strict=True):
            for name in ("qkv", "o", "gate_up", "down", "ln_in", "ln_post"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name


def _blender(w: LlamaWeights, kv_heads: int, ranks: Ranks | None
             ) -> tuple[SGLangBlender, CacheEngine]:
    layout = KVLayout.mha(num_layers=w.num_layers, num_kv_heads=kv_heads, head_dim=w.head_dim,
                          dtype=torch.float32)
    k = [torch.zeros(256, kv_heads, w.head_dim) for _ in range(w.num_layers)]
    v = [torch.zeros(256, kv_heads, w.head_dim) for _ in range(w.num_layers)]
    cfg = Config(chunk_size=16, max_local_cpu_size=0.05, save_tails=True, enable_blending=True,
                 blend_min_tokens=16, blend_recompute_ratios=(0.3,))
    engine = CacheEngine(cfg, model_name="m", layout=layout, connector=SGLangMHAConnector(k, v),
                         world_size=1 if ranks is None else TP,
                         rank=0 if ranks is None else ranks.rank)
    counters = Counters(*(f"sglang.{name}" for name in BLEND_COUNTERS))
    return SGLangBlender(w, engine.segments(), cfg.blend, [SEP], (k, v), 4, counters,
                         in_forward=True, ranks=ranks), engine


@pytest.fixture
def fleet() -> Iterator[tuple[SGLangBlender, list[SGLangBlender]]]:
    """One blender of the whole model, and the TP ranks' blenders (one KV head each)."""
    w = tiny_llama()
    group = Group(TP)
    made = [_blender(w, w.num_kv_heads, None)]
    made += [_blender(w, w.num_kv_heads // TP, Ranks(r, TP, group.reduce_for(r)))
             for r in range(TP)]
    yield made[0][0], [b for b, _ in made[1:]]
    in_forward.drop()
    for b, e in made:
        b.close()
        e.close()


def _hold(b: SGLangBlender, tokens: np.ndarray, skip: int | None = None) -> None:
    """Store `tokens`' segments (but the `skip`th) as `b`'s rank holds them: its columns."""
    for i, seg in enumerate(find_segments(tokens.tolist(), [SEP], 16)):
        if i == skip:
            continue
        ids = torch.from_numpy(tokens[seg.start:seg.end])
        kv = prefill(b.w, ids, logits=False).kv
        b.store.save(b.store.chain(ids, Segment(0, len(ids))),
                     kv if b.cols is None else kv[..., b.cols].contiguous())


def _admit(b: SGLangBlender, rid: str, tokens: np.ndarray
           ) -> tuple[Any, torch.Tensor, int | None]:
    """Drive `b` as SGLang's scheduler does (prefetch, wait, match, admission)."""
    b.prefetch(rid, tokens[:-1], "")
    deadline = time.monotonic() + 120  # a bound on a hang, not a timing
    while not b.prefetch_ready(rid):
        assert time.monotonic() < deadline
    hits = b.look(rid, tokens, 0, "")
    slots = torch.arange(hits.end)
    return hits, slots, b.fill(rid, tokens, hits, 0, slots[:0], slots, "")


def _layer(b: SGLangBlender, layer: int, slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([b.pool_k[layer][slots], b._v[layer][slots]])


def test_ranks_blend_the_rows_one_blender_of_the_whole_model_blends(
        fleet: tuple[SGLangBlender, list[SGLangBlender]]) -> None:
    whole, ranks = fleet
    tokens = _prompt(5)
    for b in (whole, *ranks):
        _hold(b, tokens)
    hits, slots, kept = _admit(whole, "whole", tokens)
    want = in_forward._pending.pop("whole").rows
    got = _in_step(*(lambda b=b, r=r: _admit(b, f"rank{r}", tokens)
                     for r, b in enumerate(ranks)))
    heads = ranks[0].pool_k[0].shape[1]
    check = whole.plan.check_layers[0]
    for r, (rank_hits, rank_slots, rank_kept) in enumerate(got):
        assert rank_hits._replace(chains=()) == hits._replace(chains=()) and rank_kept == kept
        assert torch.equal(in_forward._pending.pop(f"rank{r}").rows, want)  # the same rows
        own = slice(r * heads, (r + 1) * heads)
        for layer in range(whole.w.num_layers):
            mine = _layer(ranks[r], layer, rank_slots)
            theirs = _layer(whole, layer, slots)[:, :, own]
            if layer <= check:  # computed fresh by the job: the whole model's, its heads
                assert torch.allclose(mine, theirs, atol=1e-5)
            else:  # loaded, re-rotated: equal where kept (SGLang computes the rows it folds)
                rows = torch.tensor([i for i in range(hits.end) if i not in set(want.tolist())])
                assert torch.allclose(mine[:, rows], theirs[:, rows], atol=1e-5)
    # The planner counts SGLang's share of a job before the rows are picked: as many
    first = ranks[0]
    done = compute(first.w, first.store, first.plan, (first.pool_k, first._v), tokens,
                   got[0][0], "", upto=check, cols=first.cols)
    assert done is not None and done.deviation is not None
    assert rows_to_come(done, first.plan) == len(want)


def test_a_segment_one_rank_lost_is_computed_on_every_rank(
        fleet: tuple[SGLangBlender, list[SGLangBlender]]) -> None:
    _, ranks = fleet
    tokens = _prompt(6)
    _hold(ranks[0], tokens)
    _hold(ranks[1], tokens, skip=2)  # its tier lost the second document
    got = _in_step(*(lambda b=b, r=r: b.look(f"rank{r}", tokens, 0, "")
                     for r, b in enumerate(ranks)))
    assert got[0]._replace(chains=()) == got[1]._replace(chains=())
    assert len(got[0].held) == 2 and len(got[0].missed) == 1


def test_a_blend_one_rank_expects_to_lose_is_computed_on_every_rank(
        fleet: tuple[SGLangBlender, list[SGLangBlender]],
        caplog: pytest.LogCaptureFixture) -> None:
    """The planners measure apart: where one rank's says the blend loses, no rank blends
    (else one rank would fold rows the other's extend lacks)."""
    _, ranks = fleet
    ranks[1]._prefill_s = lambda tokens, prompt_len: 1e-9  # SGLang prefills anything at once
    ranks[1].planner.observe(100, 1.0)  # as an earlier blend measured it
    tokens = _prompt(7)
    for b in ranks:
        _hold(b, tokens)

    def admitted(b: SGLangBlender, rid: str) -> bool:
        b.prefetch(rid, tokens[:-1], "")
        while not b.prefetch_ready(rid):
            pass  # every call agrees: both ranks loop in step
        return b.worth(rid, b.look(rid, tokens, 0, "").end, 0)

    with caplog.at_level("INFO", "kvtier"):
        got = _in_step(*(lambda b=b, r=r: admitted(b, f"rank{r}") for r, b in enumerate(ranks)))
    assert got == [False, False]
    # rank 0 measured no blend yet: its log line says why it computes anyway
    assert "rank0 computed, not blended: a blend of" in caplog.text
    assert "would take unmeasured here" in caplog.text and "slower on another rank" in caplog.text
    for r, b in enumerate(ranks):
        assert f"rank{r}" not in b.jobs
        assert b.counters.snapshot()["sglang.blend_fallbacks_slower"] == 1


def test_a_blend_one_rank_failed_to_write_is_computed_on_every_rank(
        fleet: tuple[SGLangBlender, list[SGLangBlender]],
        caplog: pytest.LogCaptureFixture) -> None:
    """A rank whose copy into its pool fails makes every rank report no blend (the tree
    computes the request), with nothing registered for SGLang's extend."""
    _, ranks = fleet
    tokens = _prompt(8)
    for b in ranks:
        _hold(b, tokens)

    def broken(*args: Any) -> None:
        raise RuntimeError("the pool went away")

    ranks[1]._write = broken  # type: ignore[method-assign,assignment]
    with caplog.at_level("ERROR", "kvtier"):
        got = _in_step(*(lambda b=b, r=r: _admit(b, f"rank{r}", tokens)
                         for r, b in enumerate(ranks)))
    assert [kept for *_, kept in got] == [None, None]
    assert not in_forward._pending
    assert all(b.counters.snapshot()["sglang.blend_failures"] == 1 for b in ranks)
    assert "writing rank1's blend failed on this rank" in caplog.text
