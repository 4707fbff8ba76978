"""Tails: a prefix's partial last chunk, stored in whole pages, found by a longer prompt."""

from __future__ import annotations

import hashlib
import tracemalloc
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.redis import RedisProcess
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector, SGLangMLAConnector
from kvtier.connectors.base import KVConnector
from kvtier.engine import CacheEngine
from kvtier.keys import KeyBuilder, encode_tokens
from kvtier.keys import chunks as keys_module
from kvtier.storage import StorageManager

SLOTS = 1024
CHUNK = 16
PAGE = 4


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 30_000, (n,), generator=torch.Generator().manual_seed(seed))


_BUFFERS: dict[int, list[torch.Tensor]] = {}  # id(connector) -> its pool's layer buffers


def _mha(fill: bool, seed: int = 0) -> SGLangMHAConnector:
    gen = torch.Generator().manual_seed(seed)

    def layer() -> torch.Tensor:
        if not fill:
            return torch.zeros(SLOTS, 2, 8)
        return torch.randn(SLOTS, 2, 8, generator=gen)

    k, v = [layer() for _ in range(3)], [layer() for _ in range(3)]
    conn = SGLangMHAConnector(k, v)
    _BUFFERS[id(conn)] = k + v
    return conn


def _mla(bufs: list[torch.Tensor]) -> SGLangMLAConnector:
    conn = SGLangMLAConnector(bufs)
    _BUFFERS[id(conn)] = bufs
    return conn


def _config(**kw: object) -> Config:
    args: dict = {"chunk_size": CHUNK, "max_local_cpu_size": 0.004,
                  "key_namespace": f"t{uuid.uuid4().hex[:12]}"}
    args.update(kw)
    return Config(**args)


def _engine(conn: KVConnector, cfg: Config, storage: StorageManager | None = None,
            page: int = PAGE) -> CacheEngine:
    return CacheEngine(cfg, model_name="m", layout=conn.layout, connector=conn,
                       storage=storage, page_size=page)


def _slots(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed))[:n]


def _rows(conn: KVConnector, slots: torch.Tensor) -> list[torch.Tensor]:
    return [b[slots] for b in _BUFFERS[id(conn)]]


def _same(a: KVConnector, sa: torch.Tensor, b: KVConnector, sb: torch.Tensor) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_rows(a, sa), _rows(b, sb)))


# ---- keys ------------------------------------------------------------------------------------


def test_a_tail_is_keyed_like_the_stored_partial_chunk_of_a_shorter_prompt() -> None:
    kb = KeyBuilder(model="m", fingerprint="f", chunk_size=CHUNK, tails=True, page_size=PAGE)
    tokens = _tokens(60, 1)
    chain = kb.chain(tokens)
    assert [k.num_tokens for k in chain] == [CHUNK] * 3  # full chunks only
    for i in range(4):
        cands = chain.tails(i)
        lengths = [k.num_tokens for k in cands]
        # Longest first, whole pages, shorter than a chunk, within the 60 tokens.
        room = min(CHUNK - 1, 60 - i * CHUNK)
        assert lengths == list(range(room - room % PAGE, 0, -PAGE))
        for k in cands:
            stored = kb.keys(tokens[: k.end])  # what a store of that prefix writes
            assert stored[-1] == k
            assert k.prev == (chain[i - 1].key if i else None)
    assert [k.end for k in chain.tails(3, limit=56)] == [56, 52]


def test_tails_never_share_keys_across_salts_or_with_whole_chunks() -> None:
    kb = KeyBuilder(model="m", fingerprint="f", chunk_size=CHUNK, tails=True, page_size=1)
    tokens = _tokens(40, 2)
    plain = {k.key for i in range(3) for k in kb.chain(tokens).tails(i)}
    salted = {k.key for i in range(3) for k in kb.chain(tokens, "tenant").tails(i)}
    assert len(plain) == len(salted) == 15 + 15 + 8 and not plain & salted
    assert not plain & {k.key for k in kb.keys(tokens)[:-1]}


def test_a_chain_carries_its_salt_and_upto_cuts_its_chunks_and_tails() -> None:
    kb = KeyBuilder(model="m", fingerprint="f", chunk_size=CHUNK, tails=True, page_size=PAGE)
    tokens = _tokens(60, 3)
    chain = kb.chain(tokens, "tenant")
    assert chain.salt == "tenant" and list(chain) == kb.keys(tokens, "tenant")[:3]
    cut = chain.upto(2 * CHUNK + 8)  # inside the third chunk
    assert list(cut) == list(chain) and cut.salt == "tenant"
    assert max(k.end for k in cut.tails(2)) == 2 * CHUNK + 8  # no tail reaches past it
    assert cut.tails(2) == chain.tails(2, limit=2 * CHUNK + 8)
    assert list(chain.upto(CHUNK)) == list(chain)[:1] and not chain.upto(CHUNK).tails(1)


def test_an_engine_load_refuses_a_salt_beside_a_chain() -> None:
    engine = _engine(_mha(False), _config())
    tokens = _tokens(40, 4)
    try:
        with pytest.raises(ValueError, match="salt"):
            engine.lookup(tokens, keys=engine.key_chain(tokens, "a"), salt="a")
        assert engine.lookup(tokens, keys=engine.key_chain(tokens, "a")) == 0
    finally:
        engine.close()


def _tails_as_first_defined(kb: KeyBuilder, tokens: torch.Tensor, i: int,
                            salt: str = "") -> list[tuple]:
    """Tail candidates after `i` full chunks by the first definition: each candidate's tokens
    hashed from scratch after the digest before them, longest first."""
    data = encode_tokens(tokens).tobytes()
    h = kb.root(salt)
    for c in range(i):
        h = hashlib.sha256(h + data[c * kb.chunk_size * 4:(c + 1) * kb.chunk_size * 4]).digest()
    start = i * kb.chunk_size
    room = min(kb.chunk_size - 1, len(tokens) - start)
    out = []
    for end in range(start + room - room % kb.page_size, start, -kb.page_size):
        part = data[start * 4:end * 4]
        out.append((kb.prefix_of(salt) + hashlib.sha256(h + part).hexdigest(), start, end, part))
    return out


@pytest.mark.parametrize(("chunk", "page", "n"), [(16, 4, 60), (16, 1, 40), (8, 8, 30),
                                                  (32, 2, 95), (4, 1, 4)])
def test_tails_are_the_keys_of_their_first_definition(chunk: int, page: int, n: int) -> None:
    kb = KeyBuilder(model="m", fingerprint="f", chunk_size=chunk, tails=True, page_size=page)
    tokens = _tokens(n, chunk + page + n)
    for salt in ("", "tenant"):
        chain = kb.chain(tokens, salt)
        for i in range(len(chain) + 1):
            got = [(k.key, k.start, k.end, bytes(k.tokens)) for k in chain.tails(i)]
            assert got == _tails_as_first_defined(kb, tokens, i, salt)


def test_tails_of_a_4096_token_chunk_cost_linear_hashing_and_memory(monkeypatch) -> None:
    """Issue 36, item 7: a tail candidate per page held its own copy of its tokens (4095
    candidates, 35 MB at chunk_size 4096, page 1). Now: each token hashed once, one copy."""
    hashed = [0]

    class Counting:
        def __init__(self, d: object) -> None:
            self.d = d

        def update(self, b: bytes) -> None:
            hashed[0] += memoryview(b).nbytes
            self.d.update(b)

        def copy(self) -> Counting:
            return Counting(self.d.copy())

        def __getattr__(self, name: str) -> object:
            return getattr(self.d, name)

    def sha256(b: bytes = b"") -> Counting:
        hashed[0] += len(b)
        return Counting(hashlib.sha256(b))

    kb = KeyBuilder(model="m", fingerprint="f", chunk_size=4096, tails=True, page_size=1)
    chain = kb.chain(_tokens(2 * 4096 - 1, 7))
    monkeypatch.setattr(keys_module, "hashlib", SimpleNamespace(sha256=sha256))
    tracemalloc.start()
    try:
        cands = chain.tails(1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(cands) == 4095
    assert hashed[0] == 32 + 4095 * 4  # the digest before them, then each token once
    assert peak < 4 << 20, peak  # was 35 MB: quadratic in chunk_size
    owners = {id(k.tokens.obj) if isinstance(k.tokens, memoryview) else id(k.tokens)
              for k in cands}
    assert len(owners) == 1


def test_a_page_size_that_does_not_divide_the_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="page_size"):
        KeyBuilder(model="m", fingerprint="f", chunk_size=CHUNK, tails=True, page_size=5)


# ---- one tier ----------------------------------------------------------------------------------


def test_the_next_turn_hits_the_whole_previous_turn_down_to_the_page() -> None:
    src, dst = _mha(True), _mha(False)
    a = _engine(src, _config())
    b = _engine(dst, a.config, storage=a._storage)
    turns = _tokens(200, 3)
    rows = _slots(200, 10)  # one KV per token position, as a model computes it every turn
    prev = 0
    for turn, n in enumerate((37, 70, 93, 150)):  # each turn runs through the one before
        slots_a = rows[:n]
        # New: the chunks past the previous turn's whole chunks, and this turn's tail.
        assert a.store(turns[:n], slots_a) == n - n % PAGE - (prev - prev % CHUNK)
        prev = n - n % PAGE
        longer = turns[: n + 30]
        assert b.lookup(longer) == prev
        slots_b = _slots(n + 30, 20 + turn)
        assert b.retrieve(longer, slots_b, hot_only=True) == prev
        assert _same(src, slots_a[:prev], dst, slots_b[:prev])
    a.close()


def test_the_same_prompt_again_finds_the_tail_stored_for_it_beside_its_answers() -> None:
    src, dst = _mha(True), _mha(False)
    a = _engine(src, _config(), page=1)
    b = _engine(dst, a.config, storage=a._storage, page=1)
    answered = _tokens(47, 13)  # a 40-token prompt and its answer: 2 chunks and a 15-token tail
    slots_a = _slots(47, 9)
    assert a.store(answered, slots_a) == 47
    assert b.lookup(answered[:40], limit=39) == 32  # tails are found by exact length
    a.store(answered, slots_a, also_prefix=39)  # the prompt's own tail, beside the answer's
    assert b.lookup(answered[:40], limit=39) == 39
    slots_b = _slots(40, 10)
    assert b.retrieve(answered[:40], slots_b, limit=39) == 39
    assert _same(src, slots_a[:39], dst, slots_b[:39])
    assert b.lookup(answered) == 47  # the longer one is still there
    # Nothing to add where the prompt ends a chunk (its own chain names it); an earlier
    # chunk's inner tail: tests/engine/test_prompt_tails.py.
    assert a.store(answered, slots_a, also_prefix=32) == 0
    assert a.stats()["chunks_put"] == 4
    a.close()


def test_a_tail_is_never_served_to_a_prompt_that_diverges_inside_it() -> None:
    src, dst = _mha(True), _mha(False)
    a = _engine(src, _config(), page=1)
    b = _engine(dst, a.config, storage=a._storage, page=1)
    first = _tokens(40, 4)  # 2 chunks and an 8-token tail
    assert a.store(first, _slots(40, 1)) == 40
    other = first.clone()
    other[37] += 1  # same until token 37, inside the tail
    longer = torch.cat([other, _tokens(20, 5)])
    assert b.lookup(longer) == 32
    slots_b = _slots(60, 2)
    before = [r.clone() for r in _rows(dst, slots_b)]
    assert b.retrieve(longer, slots_b) == 32
    after = _rows(dst, slots_b)
    assert all(torch.equal(x[32:], y[32:]) for x, y in zip(before, after))
    # The tokens they share still find what was stored for them: a prefix of 37 is
    # not a stored tail, but `first` itself is.
    assert b.lookup(first) == 40 and b.lookup(other) == 32
    a.close()


def test_with_a_salt_only_the_same_salt_finds_a_tail() -> None:
    a = _engine(_mha(True), _config(), page=1)
    short = _tokens(10, 6)  # shorter than one chunk: the tail hangs off the salted root
    assert a.store(short, _slots(10, 3), salt="x") == 10
    longer = torch.cat([short, _tokens(5, 7)])
    assert a.lookup(longer, salt="x") == 10
    assert a.lookup(longer, salt="y") == 0 and a.lookup(longer) == 0
    a.close()


def test_tails_go_before_the_chunks_they_hang_off_and_never_outlive_them() -> None:
    cfg = _config(max_local_cpu_size=0.0006)  # ~14 chunks of 16 tokens x 3 layers x 2 x 32 B
    a = _engine(_mha(True), cfg, page=1)
    cpu = a._storage.hot
    prompts = [_tokens(40, 100 + seed) for seed in range(40)]
    for seed, prompt in enumerate(prompts):  # 2 chunks and a tail each: the arena overflows
        a.store(prompt, _slots(40, seed))
        for p in prompts[: seed + 1]:
            first, second, tail = a.chunk_keys(p)
            held = [cpu.batch_contains([k]) for k in (first, second, tail)]
            assert held in ([1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]), held
    assert a.stats()["cpu.evictions"] > 0
    a.close()


def test_mla_tails_round_trip() -> None:
    gen = torch.Generator().manual_seed(8)
    src = _mla([torch.randn(SLOTS, 1, 24, generator=gen) for _ in range(2)])
    dst = _mla([torch.zeros(SLOTS, 1, 24) for _ in range(2)])
    a = _engine(src, _config())
    b = _engine(dst, a.config, storage=a._storage)
    prompt = _tokens(45, 9)
    slots_a, slots_b = _slots(45, 4), _slots(60, 5)
    assert a.store(prompt, slots_a) == 44
    longer = torch.cat([prompt, _tokens(15, 10)])
    assert b.retrieve(longer, slots_b) == 44
    assert _same(src, slots_a[:44], dst, slots_b[:44])
    a.close()


# ---- lower tiers -------------------------------------------------------------------------------


@pytest.fixture(params=["disk", "redis"])
def shared_config(request: pytest.FixtureRequest, tmp_path: Path) -> Config:
    if request.param == "disk":
        return _config(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01)
    server: RedisProcess = request.getfixturevalue("redis_server")
    return _config(remote_url=server.url)


def test_a_second_server_finds_the_tail_in_a_lower_tier(shared_config: Config) -> None:
    src, dst = _mha(True), _mha(False)
    a = _engine(src, shared_config)
    prompt = _tokens(70, 11)
    slots_a = _slots(70, 6)
    assert a.store(prompt, slots_a) == 68
    assert a.flush(10)
    b = _engine(dst, shared_config)  # its own, empty CPU tier: only the lower tier has it
    longer = torch.cat([prompt, _tokens(40, 12)])
    assert b.lookup(longer, hot_only=True) == 0
    assert b.lookup(longer) == 68
    # The default (adaptive) plan reads a tail only if it beats recomputing it: a slow
    # engine makes that true whatever the tier's measured speed on a busy machine.
    b.prefill.observe(4096, 4096.0, 4096)
    prefetch = b.start_prefetch(longer)
    assert prefetch.result(10) == 4  # the whole chunks, then the tail
    assert b.lookup(longer, hot_only=True) == 68
    assert b.stats()["tails_prefetched"] == 1
    slots_b = _slots(110, 7)
    assert b.retrieve(longer, slots_b, hot_only=True) == 68
    assert _same(src, slots_a[:68], dst, slots_b[:68])
    # Streaming from the lower tier directly (no CPU tier copy yet) loads the tail too.
    c = _engine(_mha(False), shared_config)
    slots_c = _slots(110, 8)
    assert c.retrieve(longer, slots_c) == 68
    assert _same(src, slots_a[:68], c.connector, slots_c[:68])
    for engine in (a, b, c):
        engine.close()


@pytest.mark.parametrize("recompute_is_free", [True, False])
def test_adaptive_prefetch_reads_a_tail_only_when_it_beats_recomputing_it(
        tmp_path: Path, recompute_is_free: bool) -> None:
    cfg = _config(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01,
                  prefetch_policy="adaptive")
    a = _engine(_mha(True), cfg)
    prompt = _tokens(10, 14)  # shorter than a chunk: only a tail (8 tokens, 2 pages)
    assert a.store(prompt, _slots(10, 11)) == 8 and a.flush(10)
    a.close()
    b = _engine(_mha(False), cfg)  # an empty CPU tier: the tail is on disk only
    tokens_per_s = 1e12 if recompute_is_free else 1.0
    b.prefill.observe(4096, 4096 / tokens_per_s, 4096)
    longer = torch.cat([prompt, _tokens(20, 15)])
    assert b.start_prefetch(longer).result(10) == 0  # no whole chunk anywhere
    assert b.stats().get("tails_prefetched", 0) == (0 if recompute_is_free else 1)
    assert b.lookup(longer, hot_only=True) == (0 if recompute_is_free else 8)
    b.close()


def test_a_bad_limit_is_refused_before_anything_is_written() -> None:
    a = _engine(_mha(True), _config())
    prompt = _tokens(20, 16)
    a.store(prompt, _slots(20, 12))
    dst = _mha(False)
    b = _engine(dst, a.config, storage=a._storage)
    slots = _slots(20, 13)
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match="limit"):
            b.retrieve(prompt, slots, limit=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="limit"):
            b.lookup(prompt, limit=bad)  # type: ignore[arg-type]
    assert all(not r.any() for r in _rows(dst, slots))
    a.close()
