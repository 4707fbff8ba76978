"""What a blend tells SGLang about a request's cached tokens (`hooks._report_blend`),
checked against SGLang's own count (`prepare_for_extend`: `pre_len - already_computed`) on a
stand-in request. The real server: test_sglang_blending.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.sglang


@pytest.fixture
def hooks() -> Any:
    """`BlendHooks`, imported here: the module imports SGLang, and the suite collects without
    it (tests/test_collection.py)."""
    from kvtier.integration.sglang.blending.blend_hooks import BlendHooks

    return BlendHooks


def _request(prefix_len: int) -> SimpleNamespace:
    return SimpleNamespace(prefix_len=prefix_len, already_computed=0, cached_tokens_device=0,
                           cached_tokens_host=0, _cache_breakdown_computed=False)


def test_sglang_counts_only_the_device_prefix_and_the_kept_tokens(hooks: Any) -> None:
    req = _request(prefix_len=64)  # the device prefix at admission
    computed = hooks._report_blend(req, blended=1000, kept=300)
    assert computed == 700
    pre_len = 64 + 1000  # SGLang's prefix after the load: device prefix and host hit
    assert pre_len - req.already_computed == 64 + 300  # what SGLang adds to cached_tokens
    assert (req.cached_tokens_device, req.cached_tokens_host) == (64, 300)
    assert req._cache_breakdown_computed


def test_a_request_matched_again_before_its_prefill_is_counted_afresh(hooks: Any) -> None:
    req = _request(prefix_len=0)
    computed = hooks._report_blend(req, blended=500, kept=0)
    hooks._unreport_blend(req, computed)
    assert req.already_computed == 0 and not req._cache_breakdown_computed
