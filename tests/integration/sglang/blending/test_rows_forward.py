"""A blend's rows through SGLang's model before admission (`rows_forward`), in process: the
pool view over the blend's KV, the thread's own forward context, and the fallback to the fold.
On a real server (exact at a share of 1, and what the log says): test_sglang_blending.py."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtier.background import EngineActivity
from kvtier.integration.sglang.blending import in_forward, rows_forward
from kvtier.integration.sglang.blending.blend_jobs import Computed
from kvtier.integration.sglang.blending.rows_forward import (
    QUIET_CORES,
    RowsForward,
    _BlendPool,
    rows_threads,
)


def test_the_pool_is_the_blends_kv_slot_i_token_i() -> None:
    kv = torch.zeros(2, 3, 10, 8)  # [planes, layers, tokens, 2 heads x 4]
    pool = _BlendPool(kv, heads=2, head_dim=4)
    assert pool.get_key_buffer(1).shape == (10, 2, 4)
    assert pool.get_key_buffer(1).data_ptr() == kv[0, 1].data_ptr()  # a view, no copy
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    rows = torch.tensor([2, 5, 9])
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), SimpleNamespace(loc=rows), k, v)
    assert torch.equal(kv[0, 1, rows], k.view(3, 8)) and torch.equal(kv[1, 1, rows], v.view(3, 8))
    # nothing else moved: other tokens, other layers
    kv[:, 1, rows] = 0
    assert not kv.any()
    # a plain tensor of slots (SGLang before KVWriteLoc) and another dtype are taken too
    pool.set_kv_buffer(SimpleNamespace(layer_id=0), rows, k.double(), v.double())
    assert torch.equal(kv[0, 0, rows], k.view(3, 8))


def test_rows_at_is_this_threads_alone() -> None:
    rows = torch.tensor([4, 1, 7])
    seen: list[object] = []
    with in_forward.rows_at(rows):
        assert in_forward.folding() and torch.equal(in_forward.query_positions(0), rows)
        assert in_forward.query_positions(1) is None
        other = threading.Thread(target=lambda: seen.append(in_forward.query_positions(0)))
        other.start()
        other.join()
    assert seen == [None] and not in_forward.folding()


def _done(rows: list[int]) -> Computed:
    kv = torch.arange(2 * 2 * 6 * 4, dtype=torch.float32).view(2, 2, 6, 4)
    cached = torch.ones(6, dtype=torch.bool)
    return Computed(6, kv, cached, torch.zeros(6, dtype=torch.bool), 1,
                    torch.tensor(rows), 0.1, 0.2, 1)


class _Runs(RowsForward):
    """A RowsForward without a model: `run` records its calls and threads, or fails."""

    def __init__(self, fail: bool = False) -> None:
        self.broken, self.fail, self.calls = False, fail, []  # type: ignore[assignment]
        self.threads: list[int] = []

    def run(self, kv: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.calls.append((ids.tolist(), rows.tolist()))
        self.threads.append(torch.get_num_threads())
        kv[:, :, rows] = -1.0  # a partial write, then the failure
        if self.fail:
            raise RuntimeError("this SGLang's model runs no other batch")


def test_finish_runs_the_rows_in_order_and_marks_the_blend_whole() -> None:
    forward, done = _Runs(), _done([5, 0, 3])
    out = forward.finish(done, np.arange(100, 110))
    assert out.whole and not done.whole
    assert forward.calls == [(list(range(100, 106)), [0, 3, 5])]  # the prompt's tokens, sorted
    assert out.compute_s >= done.compute_s


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> EngineActivity:
    """SGLang's engine as the rows see it (its batches), fresh: no batch ran."""
    activity = EngineActivity()
    monkeypatch.setattr(rows_forward, "ENGINE", activity)
    return activity


def test_the_rows_take_every_core_only_on_a_quiet_host(engine: EngineActivity) -> None:
    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    began = time.monotonic()
    quiet = _done([1, 2])._replace(others=0.01, computed_at=began)
    assert rows_threads(quiet) == cores
    assert rows_threads(quiet._replace(others=QUIET_CORES + 0.5)) == 1  # a busy process
    assert rows_threads(quiet._replace(others=None)) == 1  # unknown: not quiet
    forward = _Runs()
    out = forward.finish(quiet, np.arange(6))
    assert forward.threads == [cores] and out.rows_threads == cores
    assert torch.get_num_threads() == before  # the thread's own team back as it was
    engine.enter()  # SGLang runs a batch (a stream's decode step) beside the blend
    engine.leave()
    assert rows_threads(quiet) == 1
    out = forward.finish(quiet, np.arange(6))
    assert forward.threads == [cores, 1] and out.rows_threads == 1
    assert out.rows_where().endswith("on 1 thread") and _done([1]).rows_where() == "forward"


def test_a_model_that_refuses_leaves_the_rows_to_the_fold(caplog: pytest.LogCaptureFixture,
                                                         ) -> None:
    forward, done = _Runs(fail=True), _done([1, 4])
    out = forward.finish(done, np.arange(6))
    # the fold recomputes those rows in every layer, so what the failed run wrote is harmless
    assert not out.whole and out is done and forward.broken
    assert "fold them into their extend from now on" in caplog.text
    assert forward.finish(_done([2]), np.arange(6)).whole is False  # not tried again
    assert len(forward.calls) == 1


@pytest.mark.sglang
def test_a_thread_with_its_own_context_reads_it_and_the_others_sglangs() -> None:
    from sglang.srt.model_executor import forward_context as fc

    rows_forward.install()
    rows_forward.install()  # once per process
    mine, theirs = fc.ForwardContext(attn_backend="mine"), fc.ForwardContext(attn_backend="theirs")
    previous = fc.set_forward_context(theirs)
    try:
        seen: dict[str, object] = {}

        def job() -> None:
            rows_forward._local.ctx = mine
            try:
                seen["job"] = fc.get_attn_backend()
            finally:
                rows_forward._local.ctx = None
            seen["after"] = fc.get_attn_backend()

        thread = threading.Thread(target=job)
        thread.start()
        thread.join()
        assert seen == {"job": "mine", "after": "theirs"}
        assert fc.get_attn_backend() == "theirs"  # the scheduler's thread: SGLang's own
    finally:
        fc.set_forward_context(previous)


@pytest.mark.sglang
def test_alone_computes_a_fresh_prompt_through_sglangs_context_into_its_own_kv() -> None:
    """`alone` (a segment computed alone for the segment worker): one extend with no cached
    prefix at positions 0..n-1, no fold (SGLang's own attention), the backend found where
    SGLang's layers look for it, and each layer's KV landing in token order."""
    from sglang.srt.model_executor import forward_context as fc

    seen: list[dict[str, object]] = []

    def model(input_ids: torch.Tensor, positions: torch.Tensor, batch: object) -> None:
        backend = fc.get_attn_backend()  # what SGLang's attention layers call
        seen.append({"ids": input_ids.tolist(), "positions": positions.tolist(),
                     "prefix": batch.extend_prefix_lens_cpu,  # type: ignore[attr-defined]
                     "folding": in_forward.folding()})
        for layer in range(3):
            k = (input_ids.double() + 10 * layer)[:, None, None].expand(-1, 2, 4)
            backend.token_to_kv_pool.set_kv_buffer(  # type: ignore[attr-defined]
                SimpleNamespace(layer_id=layer), batch.out_cache_loc, k, -k)  # type: ignore[attr-defined]

    runner = SimpleNamespace(model=SimpleNamespace(model=model), attn_backend=SimpleNamespace(),
                             token_to_kv_pool=SimpleNamespace(k_buffer=[torch.zeros(9, 2, 4)] * 3))
    kv = RowsForward(runner).alone(torch.tensor([7, 8, 9, 10, 11]))
    assert seen == [{"ids": [7, 8, 9, 10, 11], "positions": [0, 1, 2, 3, 4], "prefix": [0],
                     "folding": False}]
    assert kv.shape == (2, 3, 5, 8) and kv.dtype == torch.float32  # the pool's dtype
    want = (torch.arange(7, 12)[None, :, None] + 10 * torch.arange(3)[:, None, None]).float()
    assert torch.equal(kv[0], want.expand(3, 5, 8)) and torch.equal(kv[1], -kv[0])
    assert rows_forward._local.ctx is None  # this thread reads SGLang's context again
