"""Blends computed off the scheduler thread while their requests wait (issue 75): the request
is held until its blend is computed, admission only copies the result, and the result is the
blend the scheduler thread would have computed. The blender is driven as the radix cache
drives it, without a server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.blend.forward import prefill
from kvtier.blend.segments import Segment, find_segments
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.blending import in_forward
from kvtier.integration.sglang.blending.blender import BLEND_COUNTERS, SGLangBlender
from kvtier.keys import KeyChain
from kvtier.memory import KVLayout
from kvtier.metrics import Counters
from tests.blend.conftest import tiny_llama

SEP = 100  # tiny_llama's last token id: the separator
DOC = 24


def _make(prefill_s: float | None = None, *,
          in_forward: bool = False) -> tuple[SGLangBlender, CacheEngine]:
    w = tiny_llama()
    layout = KVLayout.mha(num_layers=w.num_layers, num_kv_heads=w.num_kv_heads,
                          head_dim=w.head_dim, dtype=torch.float32)
    shape = (256, w.num_kv_heads, w.head_dim)
    k = [torch.zeros(shape) for _ in range(w.num_layers)]
    v = [torch.zeros(shape) for _ in range(w.num_layers)]
    cfg = Config(chunk_size=16, max_local_cpu_size=0.05, save_tails=True, enable_blending=True,
                 blend_min_tokens=16)
    engine = CacheEngine(cfg, model_name="m", layout=layout, connector=SGLangMHAConnector(k, v))
    counters = Counters(*(f"sglang.{name}" for name in BLEND_COUNTERS))
    estimate = None if prefill_s is None else (lambda tokens, prompt_len: prefill_s)
    blender = SGLangBlender(w, engine.segments(), cfg.blend, [SEP], (k, v), 4, counters,
                            estimate, in_forward=in_forward)
    return blender, engine


@pytest.fixture
def blender() -> Iterator[SGLangBlender]:
    b, engine = _make()
    yield b
    b.close()
    engine.close()


def _prompt(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    parts: list[object] = [rng.integers(1, SEP, 5), [SEP]]
    for _ in range(3):
        parts += [rng.integers(1, SEP, DOC), [SEP]]
    return np.concatenate([*parts, rng.integers(1, SEP, 7)]).astype(np.int64)


def _hold_segments(b: SGLangBlender, tokens: np.ndarray) -> None:
    for seg in find_segments(tokens.tolist(), [SEP], 16):
        ids = torch.from_numpy(tokens[seg.start:seg.end])
        b.store.save(b.store.chain(ids, Segment(0, len(ids))), prefill(b.w, ids, logits=False).kv)


def _admitted(b: SGLangBlender, rid: str, tokens: np.ndarray) -> None:
    """Wait as SGLang's scheduler does: ask at each step until the request may go."""
    deadline = time.monotonic() + 120  # a bound on a hang, not a timing
    while not b.prefetch_ready(rid):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _pool(b: SGLangBlender, slots: torch.Tensor) -> list[torch.Tensor]:
    return [torch.cat([b.pool_k[layer][slots], b._v[layer][slots]])
            for layer in range(len(b.pool_k))]


def test_the_blend_is_computed_while_the_request_waits_and_copied_at_admission(
        blender: SGLangBlender, caplog: pytest.LogCaptureFixture) -> None:
    tokens = _prompt(1)
    _hold_segments(blender, tokens)
    blender.prefetch("r", tokens[:-1], "")  # as SGLang: its longest prefix
    _admitted(blender, "r", tokens)
    hits = blender.look("r", tokens, 0, "")  # the match at admission
    assert len(hits.held) == 3
    slots = torch.arange(hits.end)
    with caplog.at_level("INFO", "kvtier"):
        kept = blender.fill("r", tokens, hits, 0, slots[:0], slots, "")
    assert kept and "off the scheduler thread" in caplog.text
    off_thread = _pool(blender, slots)
    # The same request blended on the scheduler thread (no job: no prefetch) writes the same.
    other = slots + hits.end
    with caplog.at_level("INFO", "kvtier"):
        assert blender.fill("s", tokens, hits, 0, slots[:0], other, "") == kept
    assert "on the scheduler thread" in caplog.text
    for a, b in zip(off_thread, _pool(blender, other), strict=True):
        assert torch.equal(a, b)


def test_in_forward_the_admission_leaves_the_picked_rows_to_sglangs_extend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """in_forward.py: the job stops after the check layer; the admission writes its KV and
    registers the rows SGLang must compute past it (the last token, every token no segment
    gave, the share); the other rows keep the loaded KV, and none holds the buffer's
    leftovers. The rows equal what the whole blend computes in the last layer."""
    whole, engine = _make()
    part, engine2 = _make(in_forward=True)
    try:
        tokens = _prompt(3)
        for b in (whole, part):
            _hold_segments(b, tokens)
        hits = part.look("p", tokens, 0, "")
        assert whole.look("w", tokens, 0, "") == hits
        slots = torch.arange(hits.end)
        assert whole.fill("w", tokens, hits, 0, slots[:0], slots, "")  # no job: at admission
        empty = torch.empty

        def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:  # leftovers show as NaN
            t = empty(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, "empty", poisoned)
        assert part.fill("p", tokens, hits, 0, slots[:0], slots, "")
        monkeypatch.undo()
        splice = in_forward._pending.pop("p")
        assert splice.end == hits.end and int(splice.rows[-1]) == hits.end - 1
        rows = splice.rows.tolist()
        assert rows == sorted(rows) and set(range(5)) <= set(rows)  # the uncached preamble
        blended, handed = _pool(whole, slots), _pool(part, slots)
        check = max(part.plan.check_layers)
        for layer in range(len(blended)):
            assert torch.isfinite(handed[layer]).all()
            if layer <= check:  # the job's layers: the whole blend's
                assert torch.allclose(handed[layer], blended[layer], atol=1e-5)
        kept = torch.tensor([i for i in range(hits.end) if i not in set(rows)])
        assert len(kept) and torch.allclose(_pool(part, kept)[-1], _pool(whole, kept)[-1])
    finally:
        in_forward.drop()
        for b, e in ((whole, engine), (part, engine2)):
            b.close()
            e.close()


def test_a_device_prefix_at_admission_is_left_as_it_is(blender: SGLangBlender) -> None:
    """The job computed the device prefix's tokens too (it could not know them); admission
    writes only the tokens past it."""
    tokens = _prompt(2)
    _hold_segments(blender, tokens)
    blender.prefetch("r", tokens[:-1], "")  # as SGLang: its longest prefix
    _admitted(blender, "r", tokens)
    device = 6  # the preamble and its separator: what SGLang's device tree held
    hits = blender.look("r", tokens, device, "")
    slots = torch.arange(hits.end - device) + 1
    marker = torch.full_like(blender.pool_k[0][:1], 7.0)
    blender.pool_k[0][0] = marker  # a row the blend must not write
    assert blender.fill("r", tokens, hits, device, torch.arange(device) + 200, slots, "")
    assert torch.equal(blender.pool_k[0][0:1], marker)
    assert blender.counters.snapshot()["sglang.blend_tokens_loaded"] == 3 * DOC


def test_a_request_that_goes_away_drops_its_blend(blender: SGLangBlender) -> None:
    tokens = _prompt(3)
    _hold_segments(blender, tokens)
    blender.prefetch("r", tokens[:-1], "")  # as SGLang: its longest prefix
    blender.prefetch_ready("r")  # its loads are in: its blend starts
    assert "r" in blender.jobs
    blender.cancel_prefetch("r")
    assert "r" not in blender.jobs and not blender.jobs.running("r")
    hits = blender.look("r", tokens, 0, "")
    assert blender.jobs.take("r", hits.end) is None


def test_a_blend_that_would_lose_starts_no_job() -> None:
    b, engine = _make(prefill_s=1e-9)  # SGLang prefills anything at once: blends lose
    try:
        b.planner.observe(100, 1.0)  # as measured by an earlier blend
        tokens = _prompt(4)
        _hold_segments(b, tokens)
        b.prefetch("r", tokens[:-1], "")
        assert b.prefetch_ready("r") and not b.jobs.running("r")
        assert not b.worth("r", b.look("r", tokens, 0, "").end, 0)  # the match keeps the choice
        assert b.counters.snapshot()["sglang.blend_fallbacks_slower"] == 1
    finally:
        b.close()
        engine.close()


def test_while_blends_lose_the_lower_tiers_are_asked_off_the_scheduler_thread() -> None:
    """A request whose segments the CPU tier lacks asks disk and Redis whether they hold
    them (a round trip each) before it reads any: on a thread of kvtier's, never the
    scheduler's; it waits in the queue until answered, then is computed, reading none."""
    b, engine = _make(prefill_s=1e-9)  # blends lose
    asked, answer = [], threading.Event()
    lookup = b.store.lookup

    def slow_lookup(chain: KeyChain, *, hot_only: bool = False) -> int:
        if hot_only:
            return lookup(chain, hot_only=True)  # the CPU tier's index: the scheduler's own
        asked.append(threading.current_thread())
        assert answer.wait(60)  # a slow Redis
        return 16  # held there

    try:
        b.planner.observe(100, 1.0)
        b.store.lookup = slow_lookup  # type: ignore[method-assign]
        b.prefetch("r", _prompt(7)[:-1], "")  # returns at once: nothing asked on this thread
        assert not b.prefetch_ready("r") and not b.prefetch_ready("r")
        assert asked and all(t is not threading.current_thread() for t in asked)
        answer.set()
        _admitted(b, "r", _prompt(7))
        assert b.counters.snapshot()["sglang.blend_fallbacks_slower"] == 1
        state = b.requests.get("r")
        assert state is None or state.loads is None  # it read none
        assert not b.jobs.running("r")
    finally:
        answer.set()
        b.close()
        engine.close()


def test_an_opted_out_request_starts_no_blend(blender: SGLangBlender) -> None:
    """SGLang matches a request (which says whether it opted out) before its prefetch hook
    (which sees no options): the match declines it, and its prefetch then starts nothing."""
    tokens = _prompt(5)
    _hold_segments(blender, tokens)
    blender.decline("r")
    blender.prefetch("r", tokens[:-1], "")
    assert blender.prefetch_ready("r") and "r" not in blender.jobs


def test_a_prompt_the_device_holds_starts_no_blend(blender: SGLangBlender) -> None:
    """SGLang's match before the prefetch hook found the prompt on the device (a repeat): no
    blend is computed for it, and it is not held in the queue."""
    tokens = _prompt(6)
    _hold_segments(blender, tokens)
    blender.look("r", tokens, len(tokens) - 1, "")  # the match: the device holds it all
    blender.prefetch("r", tokens[:-1], "")
    assert blender.prefetch_ready("r") and "r" not in blender.jobs
    blender.look("s", tokens, 6, "")  # another request: only its preamble on the device
    blender.prefetch("s", tokens[:-1], "")
    blender.prefetch_ready("s")
    assert "s" in blender.jobs


def test_a_splice_whose_extend_starts_elsewhere_is_dropped_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    """Never expected (the extend follows the admission that wrote the rows), but counted and
    logged: SGLang's extend of a request that starts at another prefix computes none of the
    blend's rows, and the other requests' splices still fold."""
    counters = Counters("sglang.blend_fold_mismatches")
    rows = torch.tensor([3, 7])
    in_forward.add("late", in_forward.Splice(16, rows, counters))
    in_forward.add("fine", in_forward.Splice(16, rows, counters))
    reqs = [SimpleNamespace(rid="late"), SimpleNamespace(rid="fine")]
    try:
        with caplog.at_level("WARNING", "kvtier"):
            found = in_forward._take(reqs, [12, 16])
    finally:
        in_forward.drop()
    assert list(found) == [1] and torch.equal(found[1].rows, rows)
    assert counters.snapshot()["sglang.blend_fold_mismatches"] == 1
    assert "late's extend starts at 12, its blend ended at 16" in caplog.text
