"""Tenants through kvtier's HiCache backend (issue 71, item 5): the backend never sees a
`cache_salt`, only SGLang's page hashes, and SGLang seeds a request's storage hash chain with
its namespace (`get_storage_hash_str`: extra_key and cache_salt). So the same tokens under two
tenants are two sets of pages: one tenant's pages are not found under the other's hashes, and
the other tenant setting its pages overwrites none of the first's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.integration.sglang.test_sglang_hicache import (  # noqa: F401 (fixtures)
    PAGE,
    extra_info,
    fill_pages,
    host_pool,
    make_backend,
    page_bytes,
    published,
)

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("sglang_parallel_context")]


def _hashes(tokens: list[int], salt: str | None) -> list[str]:
    """SGLang's storage hashes of `tokens`' pages for a request of `salt`."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    out = get_storage_hash_str(RadixKey(tokens, cache_salt=salt), None, page_size=PAGE)
    assert isinstance(out, list)
    return out


def test_one_tenants_pages_are_neither_found_nor_overwritten_by_another(
        make_backend: Callable[..., Any]) -> None:  # noqa: F811
    tokens = list(range(100, 100 + 3 * PAGE))
    keys_a, keys_b, plain = _hashes(tokens, "tenant-a"), _hashes(tokens, "tenant-b"), \
        _hashes(tokens, None)
    assert not set(keys_a) & set(keys_b) and not set(keys_a) & set(plain)
    pool = host_pool("mha", "layer_first")
    backend = make_backend(pool)
    src_a, src_b = fill_pages(pool, 3, seed=1), fill_pages(pool, 3, seed=2)
    assert backend.batch_set_v1(keys_a, src_a, extra_info()) == [True] * 3
    assert backend.batch_exists(keys_b) == 0 and backend.batch_exists(plain) == 0
    assert backend.batch_set_v1(keys_b, src_b, extra_info()) == [True] * 3
    dst = pool.alloc(3 * PAGE)
    assert backend.batch_get_v1(keys_a, dst, extra_info()) == [True] * 3
    assert page_bytes(pool, dst, 3) == page_bytes(pool, src_a, 3)  # A's, as A set them
    assert backend.batch_get_v1(keys_b, dst, extra_info()) == [True] * 3
    assert page_bytes(pool, dst, 3) == page_bytes(pool, src_b, 3)
