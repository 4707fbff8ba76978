"""Segment records under verification, as a blending server's background thread checks them: a
segment forged in a plain Redis (written by another client through kvtier's own record format,
so every checksum and token digest holds) is served until a sampled request's segments are
computed alone again; then the forged records leave Redis and the CPU tier that had loaded them,
the fresh KV takes their place, and another instance reading Redis loads the model's own KV.
The blender is driven as the radix cache drives it, over a real Redis, without a server.
Where SGLang's model runs on the worker's thread (`RowsForward.alone`, stood in for here), it
computes the segments: the records it stores and the KV it checks them against."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from harness.redis import RedisProcess
from kvtier.blend.forward import LlamaWeights, prefill
from kvtier.blend.segments import Segment
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.engine.verify import Verdict
from kvtier.integration.sglang.blending.blender import BLEND_COUNTERS, SGLangBlender
from kvtier.integration.sglang.blending.rows_forward import RowsForward
from kvtier.keys import KeyChain
from kvtier.memory import KVLayout
from kvtier.metrics import Counters
from tests.blend.conftest import tiny_llama

SEP = 100
DOC = np.arange(1, 25, dtype=np.int64)  # 24 tokens: a chunk of 16 and a tail of 8
PROMPT = np.concatenate([[5, 6, 7, SEP], DOC, [SEP, 9, 8, 7, 6, 5, 4, 3, 2]]).astype(np.int64)


@pytest.fixture
def redis_url(redis_factory: Callable[..., RedisProcess]) -> str:
    return redis_factory().url  # a Redis of its own: forged records never leak into others


@pytest.fixture
def engines(redis_url: str) -> Iterator[Callable[[], CacheEngine]]:
    """`make()` -> a new instance's engine (an empty CPU tier) over the same Redis."""
    w = tiny_llama()
    layout = KVLayout.mha(num_layers=w.num_layers, num_kv_heads=w.num_kv_heads,
                          head_dim=w.head_dim, dtype=torch.float32)
    made: list[CacheEngine] = []

    def make() -> CacheEngine:
        pool = [torch.zeros(64, w.num_kv_heads, w.head_dim) for _ in range(2 * w.num_layers)]
        cfg = Config(chunk_size=16, max_local_cpu_size=0.05, save_tails=True,
                     enable_blending=True, blend_min_tokens=16, remote_url=redis_url)
        made.append(CacheEngine(cfg, model_name="m", layout=layout,
                                connector=SGLangMHAConnector(pool[::2], pool[1::2])))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def _blender(engine: CacheEngine, rows: RowsForward | None = None) -> SGLangBlender:
    w = tiny_llama()
    k = [torch.zeros(64, w.num_kv_heads, w.head_dim) for _ in range(w.num_layers)]
    v = [torch.zeros(64, w.num_kv_heads, w.head_dim) for _ in range(w.num_layers)]
    counters = Counters(*(f"sglang.{name}" for name in BLEND_COUNTERS))
    return SGLangBlender(w, engine.segments(), engine.config.blend, [SEP], (k, v), 4, counters,
                         rows=rows)


def _honest(w: LlamaWeights) -> torch.Tensor:
    return prefill(w, torch.from_numpy(DOC), logits=False).kv


def _write(engine: CacheEngine, kv: torch.Tensor) -> None:
    """Store `kv` as the document's segment record in `engine`'s tiers, Redis included."""
    store = engine.segments()
    assert store.save(store.chain(DOC, Segment(0, len(DOC))), kv) == len(DOC)
    assert engine.flush(30)


def _served(engine: CacheEngine) -> torch.Tensor:
    """What a blend on `engine` reads for the document (NaN where nothing was read)."""
    store = engine.segments()
    out = torch.full(_honest(tiny_llama()).shape, float("nan"))
    store.load(store.chain(DOC, Segment(0, len(DOC))), out)
    return out


def _verify(blender: SGLangBlender, rid: str, *, sampled: bool) -> dict[str, int]:
    """Finish request `rid` (the prompt) as the radix cache does; the blender's counters once
    its background thread is idle."""
    blender.finished(rid, PROMPT, "", aborted=False, verified=sampled)
    assert blender.worker.drain(60)
    return blender.counters.snapshot()


def test_a_forged_segment_in_redis_is_served_until_a_sampled_request_verifies_it(
        engines: Callable[[], CacheEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    w = tiny_llama()
    honest = _honest(w)
    forger = engines()
    _write(forger, torch.randn(honest.shape, generator=torch.Generator().manual_seed(1)))

    server = engines()
    blender = _blender(server)
    threads: list[str] = []
    check = blender.store.verify

    def verify(chain: KeyChain, kv: torch.Tensor) -> list[Verdict]:
        threads.append(threading.current_thread().name)
        return check(chain, kv)

    monkeypatch.setattr(blender.store, "verify", verify)
    assert blender.look("r", PROMPT, 0, "").held == ()  # the CPU tier is empty
    forged = _served(server)  # a load reads Redis and keeps a copy in the CPU tier
    assert not torch.allclose(forged, honest)
    assert blender.look("r", PROMPT, 0, "").cached == len(DOC)  # a blend would read it

    # A request verification did not sample changes nothing.
    assert "sglang.blend_segments_verified" not in _verify(blender, "plain", sampled=False)
    assert torch.equal(_served(server), forged)

    counts = _verify(blender, "sampled", sampled=True)
    assert threads == ["kvtier-segments"]  # never the scheduler's thread
    assert counts["sglang.blend_segments_verified"] == 1
    assert counts["sglang.blend_segments_mismatched"] == 1
    tiers = server.stats()
    assert tiers["cpu.verify_mismatch"] == 2 and tiers["redis.verify_mismatch"] == 2  # + tail
    assert server.flush(30)  # the fresh KV written in the forged records' place
    torch.testing.assert_close(_served(server), honest, rtol=0, atol=0)
    torch.testing.assert_close(_served(engines()), honest, rtol=0, atol=0)  # another instance
    blender.close()


def test_an_honest_segment_record_is_compared_and_kept(
        engines: Callable[[], CacheEngine]) -> None:
    w = tiny_llama()
    server = engines()
    _write(server, _honest(w))
    blender = _blender(server)
    counts = _verify(blender, "sampled", sampled=True)
    assert counts["sglang.blend_segments_verified"] == 1
    assert "sglang.blend_segments_mismatched" not in counts
    tiers = server.stats()
    assert tiers["cpu.verify_checked"] == 2 and tiers["redis.verify_checked"] == 2
    assert "redis.verify_mismatch" not in tiers or tiers["redis.verify_mismatch"] == 0
    torch.testing.assert_close(_served(server), _honest(w), rtol=0, atol=0)
    blender.close()


def test_a_missed_segment_is_computed_alone_and_stored_after_its_request(
        engines: Callable[[], CacheEngine]) -> None:
    server = engines()
    blender = _blender(server)
    assert len(blender.look("r", PROMPT, 0, "").missed) == 1
    counts = _verify(blender, "r", sampled=False)
    assert counts["sglang.blend_segments_stored"] == 1
    torch.testing.assert_close(_served(server), _honest(tiny_llama()), rtol=0, atol=0)
    blender.close()


class _SGLangModel(RowsForward):
    """SGLang's model as the segment worker calls it (`alone`): gives `kv` (anything but what
    kvtier's forward computes), or fails when None; remembers its callers' threads."""

    def __init__(self, kv: torch.Tensor | None) -> None:
        self.kv, self.threads = kv, []  # type: ignore[assignment]

    def alone(self, ids: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        assert torch.equal(ids, torch.from_numpy(DOC))  # the segment's tokens, from position 0
        if self.kv is None:
            raise RuntimeError("this SGLang's model runs no other batch")
        return self.kv.clone()


def test_sglangs_model_computes_the_segments_records(engines: Callable[[], CacheEngine]) -> None:
    theirs = _honest(tiny_llama()) * 1.01
    model = _SGLangModel(theirs)
    server = engines()
    blender = _blender(server, model)
    assert len(blender.look("r", PROMPT, 0, "").missed) == 1
    assert _verify(blender, "r", sampled=False)["sglang.blend_segments_stored"] == 1
    assert server.flush(30)
    torch.testing.assert_close(_served(server), theirs, rtol=0, atol=0)
    torch.testing.assert_close(_served(engines()), theirs, rtol=0, atol=0)  # Redis's too
    assert model.threads == ["kvtier-segments"]
    blender.close()


def test_sglangs_model_refutes_a_record_that_kvtiers_forward_computed(
        engines: Callable[[], CacheEngine]) -> None:
    theirs = _honest(tiny_llama()) * 1.01  # a fault in kvtier's forward, seen from SGLang's
    server = engines()
    _write(server, _honest(tiny_llama()))
    model = _SGLangModel(theirs)
    blender = _blender(server, model)
    counts = _verify(blender, "sampled", sampled=True)
    assert counts["sglang.blend_segments_verified"] == 1
    assert counts["sglang.blend_segments_mismatched"] == 1
    assert server.flush(30)
    torch.testing.assert_close(_served(server), theirs, rtol=0, atol=0)
    assert model.threads == ["kvtier-segments"]
    blender.close()


def test_a_model_that_fails_leaves_the_segments_to_kvtiers_forward(
        engines: Callable[[], CacheEngine], caplog: pytest.LogCaptureFixture) -> None:
    model = _SGLangModel(None)
    server = engines()
    blender = _blender(server, model)
    assert len(blender.look("r", PROMPT, 0, "").missed) == 1
    assert _verify(blender, "r", sampled=False)["sglang.blend_segments_stored"] == 1
    torch.testing.assert_close(_served(server), _honest(tiny_llama()), rtol=0, atol=0)
    assert "kvtier's forward computes segments from now on" in caplog.text
    counts = _verify(blender, "sampled", sampled=True)  # not tried again
    assert counts["sglang.blend_segments_verified"] == 1
    assert "sglang.blend_segments_mismatched" not in counts
    assert model.threads == ["kvtier-segments"]
    blender.close()
