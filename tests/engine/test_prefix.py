"""`CacheEngine.prefix` (issue 73, item 1): one handle carries a prompt's tokens, salt and
keys through every call, hashed once, and behaves exactly as the token ids it names."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine, Prefix
from kvtier.engine.hints import Hints

CHUNK, LAYERS, HEADS, DIM, PAGE = 16, 2, 2, 8, 4
SLOTS = 5 * CHUNK + 2 * PAGE  # five chunks and a tail of two pages


def _engine(tails: bool = True, bufs: list[torch.Tensor] | None = None) -> CacheEngine:
    gen = torch.Generator().manual_seed(0)
    if bufs is None:
        bufs = [torch.randn(2 * SLOTS, HEADS, DIM, generator=gen) for _ in range(2 * LAYERS)]
    connector = SGLangMHAConnector(bufs[:LAYERS], bufs[LAYERS:])
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.01, save_tails=tails,
                 admission_policy="always")
    return CacheEngine(cfg, model_name="m", layout=connector.layout, connector=connector,
                       page_size=PAGE)


def _tokens(seed: int, n: int = SLOTS) -> torch.Tensor:
    return torch.randint(0, 30_000, (n,), generator=torch.Generator().manual_seed(seed))


def test_a_prefix_loads_what_its_token_ids_load_and_hashes_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = _tokens(1)
    pool = [torch.randn(2 * SLOTS, HEADS, DIM) for _ in range(2 * LAYERS)]
    with _engine(bufs=pool) as eng:
        assert eng.store(eng.prefix(tokens, "tenant-a"), torch.arange(SLOTS)) == SLOTS
        hashed: list[int] = []
        chain = eng.keys.chain
        monkeypatch.setattr(eng.keys, "chain",
                            lambda *a, **k: hashed.append(1) or chain(*a, **k))
        p = eng.prefix(tokens, "tenant-a")
        assert eng.lookup(p) == SLOTS == eng.lookup(tokens, salt="tenant-a")
        assert eng.lookup(p, limit=3 * CHUNK) == 3 * CHUNK
        assert eng.start_prefetch(p).wait_ready(5)
        dest = torch.arange(SLOTS, 2 * SLOTS)
        assert eng.retrieve(p, dest) == SLOTS
        # the handle was hashed once for four calls; the token ids, once a call
        assert len(hashed) == 2
        assert all(torch.equal(b[:SLOTS], b[SLOTS:]) for b in pool)


def test_a_prefix_keeps_its_salt() -> None:
    tokens = _tokens(2)
    with _engine() as eng:
        eng.store(eng.prefix(tokens, "tenant-a"), torch.arange(SLOTS))
        assert eng.lookup(eng.prefix(tokens)) == 0
        assert eng.lookup(eng.prefix(tokens, "tenant-b")) == 0
        assert eng.lookup(tokens, salt="tenant-a") == SLOTS


def test_a_prefix_with_an_ephemeral_span_stores_only_what_comes_before_it() -> None:
    tokens = _tokens(3)
    with _engine() as eng:
        p = eng.prefix(tokens, "t")
        assert eng.store(p, torch.arange(SLOTS), hints=Hints(ephemeral_from=2 * CHUNK)) \
            == 2 * CHUNK
        assert eng.lookup(p) == 2 * CHUNK


def test_verify_takes_a_prefix() -> None:
    tokens = _tokens(4)
    with _engine(tails=False) as eng:
        p = eng.prefix(tokens, "t")
        eng.store(p, torch.arange(SLOTS))
        result = eng.verify(p, torch.arange(SLOTS))
        assert result.verdicts and not result.mismatches


@pytest.mark.parametrize("call", ["lookup", "start_prefetch", "retrieve", "store"])
def test_a_prefix_with_a_salt_or_keys_beside_it_is_refused(call: str) -> None:
    with _engine() as eng:
        p = eng.prefix(_tokens(5), "t")
        args = (p,) if call in ("lookup", "start_prefetch") else (p, torch.arange(SLOTS))
        with pytest.raises(ValueError, match="salt"):
            getattr(eng, call)(*args, salt="u")
        if call != "store":
            with pytest.raises(ValueError, match="keys"):
                getattr(eng, call)(*args, keys=p.chain)


def test_a_prefix_shares_its_chain_only_where_it_names_the_tokens() -> None:
    with _engine(tails=False) as eng:
        tokens = _tokens(6, 4 * CHUNK)
        p = eng.prefix(tokens)
        assert not p.covers(tokens)  # nothing hashed yet: nothing to share
        chain = p.chain
        assert p.covers(tokens) and p.reuse(tokens) is p
        assert not p.covers(tokens[:-1])  # without tails a shorter prompt has other keys
        assert p.reuse(tokens.clone()).chain is chain
        with pytest.raises(ValueError, match="salt"):
            Prefix(tokens, "other", eng.keys, chain=chain)


def test_a_prefix_of_another_engine_is_refused() -> None:
    with _engine() as eng, _engine() as other:
        p = other.prefix(_tokens(7))
        with pytest.raises(ValueError, match="token_ids"):
            eng.lookup(p)
        with pytest.raises(ValueError, match="token_ids"):
            eng.store(p, torch.arange(SLOTS))
