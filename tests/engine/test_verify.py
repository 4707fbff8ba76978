"""Shadow verification on real tiers (CPU and disk): honest records match, numerics of another
batch shape stay under the tolerance, and a writer bug or a changed model is caught, named,
counted and quarantined, with the fresh KV stored in its place."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector, SGLangMLAConnector
from kvtier.connectors.base import KVConnector
from kvtier.engine import CacheEngine
from kvtier.engine.verify import TOLERANCE, layer_errors, sampled, sampling_key
from kvtier.errors import ConfigError

SLOTS = 256
CHUNK = 16
LAYERS = 4


class _Pool(SGLangMHAConnector):
    """An MHA pool whose layer buffers the test keeps (to change the KV under the engine)."""

    def __init__(self, dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.k, self.v = ([torch.randn(SLOTS, 2, 8, generator=gen).to(dtype)
                           for _ in range(LAYERS)] for _ in range(2))
        super().__init__(self.k, self.v)


def _mha(dtype: torch.dtype) -> _Pool:
    return _Pool(dtype)


def _mla(dtype: torch.dtype) -> SGLangMLAConnector:
    gen = torch.Generator().manual_seed(1)
    return SGLangMLAConnector([torch.randn(SLOTS, 1, 24, generator=gen).to(dtype)
                               for _ in range(LAYERS)])


def _engine(connector: KVConnector, tmp_path: Path, **kw: object) -> CacheEngine:
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.016, save_tails=False,
                 local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05, **kw)
    return CacheEngine(cfg, model_name="m", layout=connector.layout, connector=connector)


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 30_000, (4 * CHUNK + 5,), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def slots() -> torch.Tensor:
    return torch.randperm(SLOTS, generator=torch.Generator().manual_seed(4))[:4 * CHUNK + 5]


@pytest.fixture
def mha(tmp_path: Path) -> Iterator[CacheEngine]:
    engine = _engine(_mha(torch.float32), tmp_path)
    yield engine
    engine.close()


def _stored(engine: CacheEngine, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    assert engine.store(tokens, slots) == 4 * CHUNK
    assert engine.flush(30)


def _checked(engine: CacheEngine, tier: str) -> tuple[int, int]:
    stats = engine.stats()
    return stats.get(f"{tier}.verify_checked", 0), stats.get(f"{tier}.verify_mismatch", 0)


def _pool(engine: CacheEngine) -> _Pool:
    assert isinstance(engine.connector, _Pool)
    return engine.connector


@pytest.mark.parametrize("connector", [_mha(torch.float32), _mha(torch.bfloat16),
                                       _mla(torch.float16)], ids=["mha-f32", "mha-bf16", "mla"])
def test_honest_records_match_in_every_tier(connector: KVConnector, tmp_path: Path,
                                            tokens: torch.Tensor, slots: torch.Tensor) -> None:
    engine = _engine(connector, tmp_path)
    try:
        _stored(engine, tokens, slots)
        result = engine.verify(tokens, slots)
        assert not result.mismatches and result.stored == 0
        assert {(v.tier, v.chunk) for v in result.verdicts} == {
            (tier, i) for tier in ("cpu", "disk") for i in range(4)}
        assert all(v.error == 0.0 for v in result.verdicts)  # the same bytes
        assert _checked(engine, "cpu") == (4, 0) and _checked(engine, "disk") == (4, 0)
    finally:
        engine.close()


def test_another_batch_shape_s_rounding_is_under_the_tolerance(
        mha: CacheEngine, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    _stored(mha, tokens, slots)
    gen = torch.Generator().manual_seed(7)
    pool = _pool(mha)
    for buf in [*pool.k, *pool.v]:  # float32 rounding of another batch: ~1e-7 relative
        buf[slots] += buf[slots] * 1e-6 * torch.randn(buf[slots].shape, generator=gen)
    result = mha.verify(tokens, slots)
    assert not result.mismatches and len(result.verdicts) == 8
    assert 0 < max(v.error for v in result.verdicts) < TOLERANCE[torch.float32] / 100


def test_a_writer_that_swapped_two_rows_is_caught_and_quarantined(
        mha: CacheEngine, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    bad = slots.clone()
    bad[[CHUNK + 3, CHUNK + 4]] = bad[[CHUNK + 4, CHUNK + 3]]  # valid checksums, wrong KV
    _stored(mha, tokens, bad)
    result = mha.verify(tokens, slots)
    assert {(v.tier, v.chunk, v.layer) for v in result.mismatches} == {("cpu", 1, 0),
                                                                        ("disk", 1, 0)}
    assert all(v.error > 100 * TOLERANCE[torch.float32] for v in result.mismatches)
    assert _checked(mha, "cpu") == (2, 1) and _checked(mha, "disk") == (2, 1)
    # Quarantined, and the store that followed wrote the fresh KV in its place.
    assert result.stored == 3 * CHUNK and mha.flush(30)
    again = mha.verify(tokens, slots)
    assert not again.mismatches and len(again.verdicts) == 8


def test_a_quarantine_is_announced_to_the_tier_watch(
        mha: CacheEngine, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """Routers learn from kvtier's tier events what each tier holds: a record verification
    removed is announced as removed from that tier, as an eviction is."""
    from tests.storage.test_watch import Seen

    bad = slots.clone()
    bad[[CHUNK + 3, CHUNK + 4]] = bad[[CHUNK + 4, CHUNK + 3]]
    _stored(mha, tokens, bad)
    seen = Seen()
    mha.tiers.watch(seen)
    chunk1 = mha.chunk_keys(tokens)[1].key
    result = mha.verify(tokens, slots)
    assert {v.tier for v in result.mismatches} == {"cpu", "disk"}
    removed = {(tier, key) for tier, keys, held in seen.calls if not held for key in keys}
    assert {("cpu", chunk1), ("disk", chunk1)} <= removed


def test_a_changed_model_is_named_by_its_first_differing_layer(
        mha: CacheEngine, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    _stored(mha, tokens, slots)
    pool = _pool(mha)
    for layer in range(2, LAYERS):  # one weight changed in layer 2: its KV and all after it
        pool.v[layer][slots] *= 1.05
    result = mha.verify(tokens, slots, start=CHUNK)  # the first chunk came from the pool
    assert {(v.tier, v.chunk, v.layer) for v in result.mismatches} == {("cpu", 1, 2),
                                                                        ("disk", 1, 2)}
    assert all(v.chunk >= 1 for v in result.verdicts)
    # The records from chunk 1 on were removed and the store wrote the fresh KV: a load into
    # an empty pool now brings this model's KV, never the one the records held.
    assert result.stored == 3 * CHUNK and mha.flush(30)
    rows = slots[CHUNK:4 * CHUNK]
    want = [b[rows].clone() for b in pool.v]
    for buf in [*pool.k, *pool.v]:
        buf.zero_()
    assert mha.retrieve(tokens, slots) == 4 * CHUNK
    assert all(torch.equal(b[rows], w) for b, w in zip(pool.v, want))


def test_the_chunk_where_the_computed_tokens_start_is_compared_whole(
        mha: CacheEngine, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """The pool held a prefix that ends inside chunk 1 (a system prompt): the request computed
    the rest of that chunk, so a wrong record of it is caught; chunk 0 was not computed."""
    bad = slots.clone()
    bad[[CHUNK + 1, CHUNK + 2]] = bad[[CHUNK + 2, CHUNK + 1]]  # in the pool's part of chunk 1
    _stored(mha, tokens, bad)
    result = mha.verify(tokens, slots, start=CHUNK + CHUNK // 2)
    assert min(v.chunk for v in result.verdicts) == 1
    assert {(v.tier, v.chunk, v.layer) for v in result.mismatches} == {("cpu", 1, 0),
                                                                        ("disk", 1, 0)}


def test_a_tail_that_matches_no_tier_takes_the_loaded_prefix_out_of_every_tier(
        mha: CacheEngine, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """`verify_scope: tail`: chunks 0-2 were loaded, chunk 3 computed by a changed model (its
    layer 2 on). No tier vouches for the fresh chunk, and the CPU tier, which supplied the
    prefix, holds a record that differs: the prefix it was computed over is as suspect, so
    every chunk leaves every tier, and nothing of the request is stored."""
    _stored(mha, tokens, slots)
    pool = _pool(mha)
    tail = slots[3 * CHUNK:4 * CHUNK]
    for layer in range(2, LAYERS):
        pool.v[layer][tail] *= 1.05
    result = mha.verify(tokens, slots, start=3 * CHUNK, loaded=True)
    assert {(v.tier, v.chunk, v.layer) for v in result.verdicts} == {("cpu", 3, 2),
                                                                     ("disk", 3, 2)}
    assert result.stored == 0 and result.purged == 2 * 3  # chunk 3 went in the quarantine
    assert mha.flush(30) and mha.lookup(tokens) == 0
    assert mha._storage.contains(mha.key_chain(tokens)) == 0  # disk too


def test_a_tail_that_one_tier_vouches_for_keeps_the_prefix(
        mha: CacheEngine, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """The CPU tier's record of chunk 3 matches the fresh chunk and the disk's does not: the
    fault is that record's, so only the disk loses it; the prefix stays in both tiers."""
    bad = slots.clone()
    bad[[3 * CHUNK + 1, 3 * CHUNK + 2]] = bad[[3 * CHUNK + 2, 3 * CHUNK + 1]]
    _stored(mha, tokens, bad)
    assert mha.tiers.remove([mha.key_chain(tokens)[3]], "cpu") == {"cpu": 1}
    assert mha.store(tokens, slots) == CHUNK  # the CPU tier's chunk 3 is honest again
    assert mha.flush(30)
    result = mha.verify(tokens, slots, start=3 * CHUNK, loaded=True)
    assert [(v.tier, v.chunk, v.matched) for v in result.verdicts] == [("cpu", 3, True),
                                                                       ("disk", 3, False)]
    assert result.purged == 0 and result.stored == 0  # the CPU tier holds every chunk
    assert mha.flush(30) and mha.lookup(tokens) == 4 * CHUNK
    assert mha._storage.lower_tiers[0].batch_contains(mha.key_chain(tokens)) == 3


def test_nothing_is_compared_without_a_record(mha: CacheEngine, tokens: torch.Tensor,
                                             slots: torch.Tensor) -> None:
    result = mha.verify(tokens, slots)
    assert result.verdicts == [] and result.stored == 4 * CHUNK
    assert _checked(mha, "cpu") == (0, 0)


def test_sampling_is_a_stable_share_of_request_ids() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    key = b"k" * 16  # a fixed key: the same answers every time
    assert not any(sampled(r, 0.0, key) for r in ids) and all(sampled(r, 1.0, key) for r in ids)
    share = sum(sampled(r, 0.1, key) for r in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert [sampled(r, 0.1, key) for r in ids] == [sampled(r, 0.1, key) for r in ids]
    with pytest.raises(ValueError, match="at least 16 bytes"):
        sampled("req-0", 0.5, b"")  # an empty key would be the unkeyed hash a client computes


def test_which_requests_are_sampled_is_a_server_secret() -> None:
    """Issue 67: clients set request ids, and an unkeyed hash of the id let a client find an
    id that is verified (or one that is not) in a few local guesses. Keyed by a secret each
    server draws, two servers choose different requests, each still the share asked for."""
    ids = [f"req-{i}" for i in range(2000)]
    chosen = []
    for key in (sampling_key(), sampling_key()):
        picks = {r for r in ids if sampled(r, 0.5, key)}
        assert 0.45 < len(picks) / len(ids) < 0.55
        chosen.append(picks)
    assert chosen[0] != chosen[1]
    assert len(chosen[0] ^ chosen[1]) > 0.3 * len(ids)  # independent keys: about half differ
    engines = [CacheEngine(Config(chunk_size=CHUNK, max_local_cpu_size=0.001,
                                  verify_fraction=0.5), model_name="m", layout=pool.layout,
                           connector=pool) for pool in (_mha(torch.float32),) * 2]
    try:
        first, second = ({r for r in ids if e.verifies(r)} for e in engines)
        assert first != second and 0.45 < len(first) / len(ids) < 0.55
    finally:
        for engine in engines:
            engine.close()


def test_layer_errors_are_relative_per_layer() -> None:
    held = torch.ones(2, 3, 4, 8)
    fresh = held.clone()
    fresh[:, 1] *= 1.1
    errors = layer_errors(fresh, held)
    assert errors.tolist() == pytest.approx([0.0, 0.1, 0.0])


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_verify_fraction_outside_0_1_is_refused(value: float) -> None:
    with pytest.raises(ConfigError, match="verify_fraction"):
        Config(verify_fraction=value)


def test_a_verify_scope_other_than_full_or_tail_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="verify_scope: must be one of full, tail, got 'head'"):
        Config(verify_scope="head")


def test_without_a_cpu_tier_the_lower_tiers_are_verified(tmp_path: Path, tokens: torch.Tensor,
                                                         slots: torch.Tensor) -> None:
    engine = _engine(_mha(torch.float32), tmp_path, local_cpu=False)
    try:
        bad = slots.clone()
        bad[[3, 4]] = bad[[4, 3]]
        _stored(engine, tokens, bad)
        result = engine.verify(tokens, slots)
        assert [(v.tier, v.chunk, v.layer) for v in result.mismatches] == [("disk", 0, 0)]
        assert engine.flush(30)
        assert not engine.verify(tokens, slots).mismatches  # the fresh KV replaced it
    finally:
        engine.close()


def test_a_nan_on_one_side_only_is_a_mismatch_and_on_both_is_not() -> None:
    held = torch.randn(2, 3, 4, 8)
    fresh = held.clone()
    fresh[0, 1, 2, 3] = float("nan")
    held[0, 2, 0, 0] = fresh[0, 2, 0, 0] = float("nan")
    assert layer_errors(fresh, held).tolist() == [0.0, math.inf, 0.0]


@pytest.mark.parametrize("value", ["", "a b", "x" * 65])
def test_a_model_fingerprint_that_cannot_be_a_key_component_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="model_fingerprint"):
        Config(model_fingerprint=value)


def test_kvtier_verify_refuses_an_unknown_scope_before_any_request(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["verify", "--server", "http://127.0.0.1:1", "--scope", "head"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--scope" in err and "'head'" in err and "cannot reach" not in err


@pytest.mark.parametrize("fraction", ["2", "-0.1", "half"])
def test_kvtier_verify_refuses_a_fraction_outside_0_1_before_any_request(
        fraction: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli.main import main

    try:
        code = main(["verify", "--server", "http://127.0.0.1:1", "--fraction", fraction])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "--fraction" in err and "cannot reach" not in err
