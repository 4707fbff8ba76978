"""`kvtier.integration.sglang.launch.cpu_attention` against its oracle, SGLang's own
`TorchNativeAttnBackend._run_sdpa_forward_extend`: the same output for every row, with and
without a cached prefix, with GQA, and the cases it leaves to SGLang (in-process, no server;
what a server logs and saves: tests/integration/sglang/test_sglang_quality.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from kvtier.integration.sglang.blending import in_forward
from kvtier.integration.sglang.launch import cpu_attention
from kvtier.integration.sglang.launch.cpu import prepare_cpu_engine

pytestmark = pytest.mark.sglang  # imports SGLang in-process

HEADS, KV_HEADS, DIM = 4, 2, 16


def _batch(prefixes: Sequence[int], extends: Sequence[int], *, seed: int = 0,
           pool_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A pool holding each request's prefix + extension at shuffled slots, and the extension's
    queries, as SGLang hands them to the backend."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(prefixes) + sum(extends)
    slots = torch.randperm(total + 8, generator=gen)[:total]
    req_to_token = torch.zeros(len(prefixes) + 2, 64, dtype=torch.int64)
    rows = torch.tensor([len(prefixes) + 1 - i for i in range(len(prefixes))])
    start = 0
    for row, (p, e) in zip(rows.tolist(), zip(prefixes, extends, strict=True), strict=True):
        req_to_token[row, :p + e] = slots[start:start + p + e]
        start += p + e
    n_q = sum(extends)
    return {
        "query": torch.randn(n_q, HEADS, DIM, generator=gen),
        "output": torch.full((n_q, HEADS, DIM), float("nan")),
        "k_cache": torch.randn(total + 8, KV_HEADS, DIM, generator=gen).to(pool_dtype),
        "v_cache": torch.randn(total + 8, KV_HEADS, DIM, generator=gen).to(pool_dtype),
        "req_to_token": req_to_token, "req_pool_indices": rows,
        "seq_lens": torch.tensor([p + e for p, e in zip(prefixes, extends, strict=True)]),
        "extend_prefix_lens": torch.tensor(list(prefixes)),
        "extend_seq_lens": torch.tensor(list(extends)),
    }


def _sglangs() -> Callable[..., torch.Tensor]:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    original = TorchNativeAttnBackend._run_sdpa_forward_extend
    return getattr(original, "__wrapped__", original)  # never through an installed hook


def _both(batch: dict[str, Any], **flags: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(SGLang's output, the hook's output, calls the hook passed on to SGLang)."""
    sglang = _sglangs()
    expected = sglang(None, **{**batch, "output": batch["output"].clone()}, **flags)
    passed = []

    def original(*args: Any, **kwargs: Any) -> torch.Tensor:
        passed.append(1)
        return sglang(*args, **kwargs)

    got = cpu_attention.extend_over_prefix(original, None, **batch, **flags)
    return expected, got, len(passed)


@pytest.mark.parametrize(("prefixes", "extends"), [
    ((24,), (8,)),              # one request behind a cached prefix
    ((0, 17, 5), (9, 1, 30)),   # a fresh request beside two with prefixes, one of one token
    ((40, 3), (4, 12)),
])
def test_an_extend_over_a_prefix_matches_sglangs_row_for_row(
        prefixes: tuple[int, ...], extends: tuple[int, ...]) -> None:
    batch = _batch(prefixes, extends)
    expected, got, passed = _both(batch, scaling=DIM ** -0.5, enable_gqa=True, causal=True)
    assert passed == 0 and got is batch["output"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_pool_in_another_dtype_is_read_in_the_queries_dtype() -> None:
    batch = _batch((20,), (6,), pool_dtype=torch.bfloat16)
    expected, got, _ = _both(batch, enable_gqa=True, causal=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags", [
    {"causal": True},                                       # no request has a prefix
    {"causal": False},                                      # an encoder's attention
    {"causal": True, "sliding_window_size": 4},             # a sliding window
    {"causal": True, "is_cross_attn": True, "encoder_lens": torch.tensor([3])},
])
def test_what_it_does_not_cover_runs_sglangs_code(flags: dict[str, Any]) -> None:
    prefix = 0 if set(flags) == {"causal"} and flags["causal"] else 12
    batch = _batch((prefix,), (5,))
    called: list[dict[str, Any]] = []

    def original(*args: Any, **kwargs: Any) -> str:
        called.append(kwargs)
        return "sglang's"

    assert cpu_attention.extend_over_prefix(original, None, **batch, enable_gqa=True,
                                            **flags) == "sglang's"
    assert called and called[0]["sliding_window_size"] == flags.get("sliding_window_size")


def test_the_launcher_asks_its_workers_for_the_hook_unless_the_config_says_no(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, str] = {}
    done = prepare_cpu_engine(env, prefix_attention=True)
    assert env[cpu_attention.HOOK_ENV] == "1" and any("cpu_prefix_attention" in d for d in done)
    prepare_cpu_engine(env, prefix_attention=False)  # an inherited variable is dropped too
    assert cpu_attention.HOOK_ENV not in env
    monkeypatch.setattr(cpu_attention, "_installed", [])
    monkeypatch.setattr(in_forward, "_installed", [])
    registered: list[str] = []
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "register",
                        lambda target, hook, kind: registered.append(target))
    monkeypatch.delenv(cpu_attention.HOOK_ENV, raising=False)
    cpu_attention.install_if_asked()
    assert registered == [] and not cpu_attention.installed()
    monkeypatch.setitem(os.environ, cpu_attention.HOOK_ENV, "1")
    cpu_attention.install_if_asked()
    cpu_attention.install()  # the demo's plugin too: once per process
    # the attention and the blend's fold into SGLang's forward (in_forward.py), once
    assert registered == [cpu_attention.TARGET, *in_forward.TARGETS.values()]
    assert cpu_attention.installed()


def test_a_blends_rows_folded_into_an_extend_attend_up_to_their_own_positions() -> None:
    """in_forward.py: a blend's rows (positions 2, 5, 9, all below the extend's own 18, 19)
    run in one extend with the last tokens; each row gives the output SGLang's full causal
    prefill gives that position, over the same keys. A request beside it is not folded."""
    full = _batch((0, 0), (20, 12), seed=3)
    flags: dict[str, Any] = {"scaling": DIM ** -0.5, "enable_gqa": True, "causal": True}
    expected = _sglangs()(None, **{**full, "output": full["output"].clone()}, **flags)
    rows = torch.tensor([2, 5, 9, 18, 19])
    beside = torch.arange(20, 32)  # the second request's rows in the full batch
    folded = {**full, "query": full["query"][torch.cat([rows, beside])],
              "output": torch.full((len(rows) + 12, HEADS, DIM), float("nan")),
              "extend_prefix_lens": torch.tensor([20 - len(rows), 0]),
              "extend_seq_lens": torch.tensor([len(rows), 12])}
    in_forward._active.fold = in_forward._Fold(torch.cat([rows, torch.arange(12)]), {0: rows})
    try:
        assert in_forward.folding() and in_forward.query_positions(1) is None
        got = cpu_attention.extend_over_prefix(_sglangs(), None, **folded, **flags)
    finally:
        in_forward._active.fold = None
    assert torch.allclose(got[:len(rows)], expected[rows], atol=1e-5)
    assert torch.allclose(got[len(rows):], expected[beside], atol=1e-5)
    assert not in_forward.folding()


@pytest.mark.parametrize("n", [0, 1, 7, 40])
def test_folded_rows_in_any_order_attend_in_blocks_as_under_one_mask(n: int) -> None:
    """`_at_positions` computes rows in blocks by position, each over the keys up to its
    last row: the same outputs, in the rows' own order, as one mask over every key."""
    from torch.nn.functional import scaled_dot_product_attention

    gen = torch.Generator().manual_seed(n)
    keys = 64
    rows = torch.randperm(keys, generator=gen)[:n]  # shuffled: any order
    q = torch.randn(1, HEADS, n, DIM, generator=gen)
    k, v = (torch.randn(1, KV_HEADS, keys, DIM, generator=gen) for _ in range(2))
    mask = torch.arange(keys).unsqueeze(0) <= rows.unsqueeze(1)
    expected = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                            scale=DIM ** -0.5)
    got = cpu_attention._at_positions(q, k, v, rows, DIM ** -0.5, True)
    assert torch.allclose(got, expected, atol=1e-5)
