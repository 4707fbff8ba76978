"""kvtier inside real SGLang servers on CPU, CPU tier only: tiny Llama (MHA) at page size 1
and a tiny DeepSeek-style MLA model at page size 4 and TP 2 (MLA KV is the same on every rank:
each rank keeps it in its own CPU tier and loads it; only rank 0 would write it down). (Llama at
page size 4 runs in test_sglang_tiers.py, with the disk and Redis tiers.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.sglang_server import SGLangServer
from tests.integration.sglang.conftest import (
    PROMPT_LEN,
    check_conversation,
    check_partial_hit,
    check_reload_after_flush,
    check_unrelated_miss,
    cold,
    full_hit,
    prompt,
    write_config,
)

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module", params=[("llama", 1, 1), ("mla", 4, 2)],
                ids=["llama-page1", "mla-page4-tp2"])
def server(request: pytest.FixtureRequest, start_server: Callable[..., SGLangServer],
           tmp_path_factory: pytest.TempPathFactory) -> SGLangServer:
    kind, page, tp = request.param
    model = request.getfixturevalue("tiny_llama" if kind == "llama" else "tiny_mla")
    config = write_config(tmp_path_factory.mktemp("cfg") / "kvtier.yaml")
    return start_server(model, config, "--page-size", str(page), "--tp", str(tp))


def test_prefix_loaded_after_flush(server: SGLangServer) -> None:
    check_reload_after_flush(server, seed=1)


def test_each_turn_of_a_conversation_hits_the_previous_turn_down_to_the_page(
        server: SGLangServer) -> None:
    check_conversation([server], seed=5)


@pytest.mark.parametrize("new_tokens", [8, 24], ids=["answer-in-its-chunk", "answer-crosses"])
def test_a_prompt_sent_again_hits_all_but_its_last_token(server: SGLangServer,
                                                         new_tokens: int) -> None:
    """Not a whole number of chunks: the tail of the prompt alone is stored beside the
    prompt and its answer, whether the answer ends in the chunk the prompt ends in (40 + 8)
    or crosses into the next one (40 + 24: the prompt hit its whole chunks only, issue 74)."""
    ids = prompt(6 + new_tokens, 40)
    expected = cold(server, ids, new_tokens)
    assert server.generate(ids, new_tokens)["output_ids"] == expected
    server.flush_cache()
    again = server.generate(ids, new_tokens)
    assert again["meta_info"]["cached_tokens"] == full_hit(server, 40)
    assert again["output_ids"] == expected


def test_partial_prefix_hit(server: SGLangServer) -> None:
    check_partial_hit(server, seed=2)


def test_unrelated_prompt_misses(server: SGLangServer) -> None:
    check_unrelated_miss(server, seed=3)


def test_cache_salt_scopes_what_a_request_shares(server: SGLangServer) -> None:
    """A request's `cache_salt` is mixed into kvtier's keys: the same prompt and salt hit
    after a flush; another salt, or none, never sees them."""
    ids = prompt(4, PROMPT_LEN)
    expected = cold(server, ids)

    def salted(salt: str | None) -> dict:  # type: ignore[type-arg]
        body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,
                                                      "ignore_eos": True}}
        if salt is not None:
            body["cache_salt"] = salt
        return server.post("/generate", body)

    assert salted("tenant-a")["meta_info"]["cached_tokens"] == 0
    server.flush_cache()  # also waits for kvtier's background stores
    for salt in ("tenant-b", None):
        got = salted(salt)
        assert got["meta_info"]["cached_tokens"] == 0, salt  # not theirs to see
        assert got["output_ids"] == expected
        server.flush_cache()
    got = salted("tenant-a")
    assert got["meta_info"]["cached_tokens"] == full_hit(server)
    assert got["output_ids"] == expected
