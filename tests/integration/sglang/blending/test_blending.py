"""The SGLang blending glue in process: which slots hold blended KV (SGLang's own allocator frees
them), the separator as the real tokenizer splits it in a prompt, the per-request switch, and
the refusal of MLA engines. The blended prefill on a real server is test_sglang_blending.py."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtier import CacheEngine
from kvtier.blend.segments import find_segments
from kvtier.config import Config
from kvtier.demo import texts
from kvtier.errors import ConfigError
from kvtier.integration.sglang.blending.blend_model import separator_ids
from kvtier.integration.sglang.blending.blended_slots import BlendedSlots
from kvtier.integration.sglang.rank.adapter import build_connector
from kvtier.integration.sglang.rank.requests import wants_blend
from tests.integration.sglang.test_sglang_pools import make_allocator, make_pool

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("sglang_parallel_context")]


@pytest.mark.parametrize("page_size", [1, 16])
def test_blended_slots_are_marked_until_sglang_frees_them(page_size: int) -> None:
    pool = make_pool("mha", page_size, torch.float32)
    allocator = make_allocator(pool, page_size)
    marks = BlendedSlots(allocator, pool.k_buffer[0].shape[0], torch.device("cpu"))
    exact, blended = allocator.alloc(32), allocator.alloc(32)
    marks.mark(blended)
    path = torch.cat([exact, blended])
    assert marks.exact_prefix(path) == 32 and marks.exact_prefix(exact) == 32
    assert marks.exact_prefix(torch.cat([blended, exact])) == 0
    allocator.free(blended)  # evicted: the slots' next owner computes exact KV there
    again = allocator.alloc(32)
    assert marks.exact_prefix(torch.cat([exact, again])) == 64
    marks.mark(again)
    marks.clear()  # a flush empties the pool
    assert marks.exact_prefix(again) == 32


def test_the_separator_is_found_where_the_tokenizer_puts_it_in_a_prompt(
        real_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model)
    rng = random.Random(0)
    docs = [" ".join(texts.record(i, f) for i, f in enumerate(texts.facts(rng, 6)))
            for _ in range(3)]
    for text in (" # # ", "\n###\n"):
        sep = separator_ids(tok, text)
        ids = tok.encode("Records:" + text + "".join(d + text for d in docs) + "Question?")
        segments = find_segments(ids, sep, min_tokens=20)
        assert [tok.decode(ids[s.start:s.end]).strip() for s in segments] == docs, text
    assert separator_ids(tok, "\n\n") == tuple(tok.encode("\n\n"))  # whitespace alone: whole
    with pytest.raises(ConfigError, match="blend_special_str"):
        separator_ids(tok, "")


def test_a_request_opts_out_with_custom_params_only() -> None:
    def req(custom: object) -> SimpleNamespace:
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom))

    assert wants_blend(req(None)) and wants_blend(req({"other": 1}))
    assert wants_blend(req({"kvtier_blend": True})) and wants_blend(SimpleNamespace())
    assert not wants_blend(req({"kvtier_blend": False}))


def test_an_mla_engine_has_no_segment_store(tmp_path: Path) -> None:
    pool = make_pool("mla", 1, torch.bfloat16)
    connector = build_connector(pool)
    with CacheEngine(Config(chunk_size=16, max_local_cpu_size=0.01), model_name="m",
                     layout=connector.layout, connector=connector) as engine:
        with pytest.raises(ValueError, match="MHA/GQA KV only"):
            engine.segments()
    mha = build_connector(make_pool("mha", 1, torch.float32))
    with CacheEngine(Config(chunk_size=16, max_local_cpu_size=0.01), model_name="m",
                     layout=mha.layout, connector=mha) as engine:
        store = engine.segments()
        ids = np.arange(40)
        kv = torch.randn(mha.layout.shape(40))
        chain = store.chain(ids.tolist(), find_segments(list(ids) + [999], [999])[0])
        assert store.save(chain, kv) == 40 and store.lookup(chain, hot_only=True) == 40  # + tail
