"""A prompt sent again hits all but its last token, whatever its answer's length: a store of
prompt and answer also keeps the prompt's own tail (`CacheEngine.store(also_prefix=)`). The
chunk that holds the prompt's end is named by answer tokens too once the answer crosses a
chunk boundary, so the prompt alone cannot find it (issue 74, item 2)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from tests.test_engine_device_path import CopiesOnCPU

CHUNK, SLOTS = 16, 512


def _pool(seed: int | None) -> SGLangMHAConnector:
    """A pool of random KV (`seed`), or of zeros (None: a pool to load into)."""
    gen = torch.Generator().manual_seed(seed or 0)

    def layer() -> torch.Tensor:
        return torch.zeros(SLOTS, 2, 8) if seed is None else torch.randn(SLOTS, 2, 8,
                                                                          generator=gen)

    return SGLangMHAConnector([layer() for _ in range(2)], [layer() for _ in range(2)])


def _config(**kw: object) -> Config:
    return Config(chunk_size=CHUNK, max_local_cpu_size=0.01,
                  key_namespace=f"t{uuid.uuid4().hex[:12]}", **kw)  # type: ignore[arg-type]


def _engine(conn: SGLangMHAConnector, cfg: Config, page: int, *,
            shares: CacheEngine | None = None) -> CacheEngine:
    return CacheEngine(cfg, model_name="m", layout=conn.layout, connector=conn, page_size=page,
                       storage=None if shares is None else shares._storage)


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 30_000, (n,), generator=torch.Generator().manual_seed(seed))


def _slots(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed))[:n]


def _same(a: SGLangMHAConnector, sa: torch.Tensor, b: SGLangMHAConnector,
          sb: torch.Tensor) -> bool:
    return all(torch.equal(x[sa], y[sb]) for x, y in zip(a._layers, b._layers))


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("answer", [3, 8, 40], ids=["same-chunk", "crosses", "crosses-3"])
def test_the_same_prompt_hits_all_but_its_last_token_whatever_the_answer(
        page: int, answer: int) -> None:
    src, dst = _pool(1), _pool(None)
    a = _engine(src, _config(), page)
    b = _engine(dst, a.config, page, shares=a)
    n = 43  # two whole chunks and 11 tokens; a repeat loads 42 of them, in whole pages
    seq = _tokens(n + answer, 2)  # prompt and answer
    slots = _slots(len(seq), 3)
    keyed = len(seq) - len(seq) % page
    assert a.store(seq, slots, also_prefix=n - 1) == keyed  # the prompt's tail is not counted
    hit = (n - 1) // page * page
    assert b.lookup(seq[:n], limit=n - 1) == hit  # was 32 once the answer crossed 48
    into = _slots(n, 4)
    assert b.retrieve(seq[:n], into, limit=n - 1) == hit
    assert _same(src, slots[:hit], dst, into[:hit])
    assert b.lookup(seq) == keyed  # the whole sequence is still found, for the next turn
    assert a.stats()["tokens_stored"] == keyed
    a.close()


def test_a_prompt_inside_the_first_chunk_keeps_its_tail_under_its_salt_only() -> None:
    src, dst = _pool(5), _pool(None)
    a = _engine(src, _config(), 1)
    b = _engine(dst, a.config, 1, shares=a)
    seq = _tokens(11 + 30, 6)  # an 11-token prompt and an answer past the second chunk
    slots = _slots(len(seq), 7)
    a.store(seq, slots, also_prefix=10, salt="tenant")
    assert b.lookup(seq[:11], limit=10, salt="tenant") == 10
    assert b.lookup(seq[:11], limit=10) == b.lookup(seq[:11], limit=10, salt="other") == 0
    into = _slots(11, 8)
    assert b.retrieve(seq[:11], into, limit=10, salt="tenant") == 10
    assert _same(src, slots[:10], dst, into[:10])
    a.close()


@pytest.mark.parametrize("prompt_end", [CHUNK, 2 * CHUNK])
def test_nothing_is_added_where_the_prompt_ends_a_chunk(prompt_end: int) -> None:
    a = _engine(_pool(9), _config(), 1)
    seq = _tokens(3 * CHUNK + 5, 10)
    a.store(seq, _slots(len(seq), 11), also_prefix=prompt_end)
    assert a.stats()["chunks_put"] == 4  # three chunks and the answer's tail: the prompt's
    assert a.lookup(seq[:prompt_end + 1], limit=prompt_end) == prompt_end  # chunks serve it
    a.close()


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu-pool", "device-path"])
def test_the_prompts_tail_reaches_the_lower_tier_after_its_chunk(
        tmp_path: Path, device_path: bool) -> None:
    """Writers drop a record whose predecessor they do not hold (an orphan): the prompt's
    tail is put after the chunks, on the device path too."""
    cfg = _config(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01)
    src = _pool(12)
    a = _engine(src, cfg, 4)
    if device_path:  # what a CUDA pool gets (tests/test_engine_device_path.py)
        a._device = a._saver._device = a._loader._device = \
            CopiesOnCPU(src)  # type: ignore[assignment]
    n = 2 * CHUNK + 9
    seq = _tokens(n + 20, 13)
    slots = _slots(len(seq), 14)
    a.store(seq, slots, also_prefix=n - 1)
    assert a.flush(10)
    assert a.stats().get("disk.writes_lost", 0) == 0
    dst = _pool(None)
    c = _engine(dst, cfg, 4)  # its own, empty CPU tier: only the disk has the records
    into = _slots(n, 15)
    assert c.retrieve(seq[:n], into, limit=n - 1) == 2 * CHUNK + 8
    assert _same(src, slots[:2 * CHUNK + 8], dst, into[:2 * CHUNK + 8])
    c.close()
    a.close()
