"""The HiCache L3 contract of `KVTierHiCacheStorage`, built the way SGLang builds it
(`StorageBackendFactory.create_backend("dynamic", ...)`), against real host pools on CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu import cuda
from tests.integration.conftest import write_config

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("sglang_parallel_context")]

PAGE = 4


def storage_class() -> type:
    """kvtier's HiCache backend (a subclass of SGLang's: imported when a test runs, so the
    module is collected without SGLang)."""
    from kvtier.integration.sglang.hicache_storage import KVTierHiCacheStorage

    return KVTierHiCacheStorage


def extra_info(**kwargs: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(**kwargs)


def host_pool(kind: str, layout: str, device: str = "cpu") -> Any:
    """A device pool and its HiCache host mirror: on a CPU server the mirror is pageable, on a
    GPU server (`device="cuda"`) it is pinned, as SGLang allocates it there."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    common = {"host_to_device_ratio": 2.0, "host_size": 0, "page_size": PAGE,
              "layout": layout, "pin_memory": device == "cuda", "device": "cpu"}
    if kind == "mha":
        dev = MHATokenToKVPool(64, page_size=PAGE, dtype=torch.bfloat16, head_num=2,
                               head_dim=8, layer_num=3, device=device,
                               enable_memory_saver=False)
        cls, info, kwargs = _mha_host_inputs(dev)
        return cls(info, **kwargs, **common)
    dev = MLATokenToKVPool(64, page_size=PAGE, dtype=torch.float32, kv_lora_rank=32,
                           qk_rope_head_dim=8, layer_num=2, device=device,
                           enable_memory_saver=False)
    return MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, device_capacity_tokens=dev.size,
        start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=dev.layer_num,
        override_kv_cache_dim=dev.kv_cache_dim, **common)


@pytest.fixture
def make_backend(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(pool: Any, *, is_mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
             **config: Any) -> Any:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        cfg = write_config(tmp_path / f"kvtier-{len(made)}.yaml", **config)
        storage_config = HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=is_mla, enable_storage_metrics=False,
            is_page_first_layout=pool.layout == "page_first", model_name="org/tiny-model",
            extra_config={"backend_name": "kvtier",
                          "module_path": "kvtier.integration.sglang.hicache_storage",
                          "class_name": "KVTierHiCacheStorage", "interface_v1": 1,
                          "kvtier_config_file": str(cfg)})
        backend = StorageBackendFactory.create_backend("dynamic", storage_config, pool)
        backend.register_mem_pool_host(pool)  # as SGLang's cache controller does
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def fill_pages(pool: Any, num_pages: int, seed: int) -> torch.Tensor:
    """Host indices of `num_pages` pages filled with random bytes."""
    indices = pool.alloc(num_pages * PAGE)
    assert indices is not None
    gen = torch.Generator().manual_seed(seed)
    for i in range(num_pages):
        page = pool.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, page.view(torch.uint8).shape, dtype=torch.uint8,
                            generator=gen)
        pool.set_from_flat_data_page(int(indices[i * PAGE]), raw.view(page.dtype))
    return indices


def page_bytes(pool: Any, indices: torch.Tensor, num_pages: int) -> list[bytes]:
    return [pool.get_data_page(int(indices[i * PAGE]), flat=True).contiguous()
            .view(torch.uint8).numpy().tobytes() for i in range(num_pages)]


KEYS = ["a1" * 32, "b2" * 32, "c3" * 32]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("kind,layout", [("mha", "layer_first"), ("mha", "page_first"),
                                         ("mla", "layer_first")])
def test_set_exists_get_round_trip(make_backend: Callable[..., Any], kind: str,
                                   layout: str, device: str) -> None:
    pool = host_pool(kind, layout, device)
    backend = make_backend(pool, is_mla=kind == "mla")
    assert isinstance(backend, storage_class())
    src = fill_pages(pool, 3, seed=1)
    assert backend.batch_exists(KEYS) == 0

    info = extra_info(prefix_keys=["00" * 32])
    assert backend.batch_set_v1(KEYS, src, info) == [True, True, True]
    assert backend.batch_exists(KEYS, info) == 3
    assert backend.batch_exists([*KEYS, "dd" * 32]) == 3
    assert backend.batch_exists(["dd" * 32, *KEYS]) == 0

    dst = pool.alloc(3 * PAGE)
    assert backend.batch_get_v1(KEYS, dst, info) == [True, True, True]
    assert page_bytes(pool, dst, 3) == page_bytes(pool, src, 3)

    # Prefix semantics: nothing after a missing page is reported as loaded.
    assert backend.batch_get_v1([KEYS[0], "ee" * 32, KEYS[2]], dst) == [True, False, False]


def test_get_and_set_copy_single_pages(make_backend: Callable[..., Any]) -> None:
    pool = host_pool("mha", "layer_first")
    backend = make_backend(pool)
    src = fill_pages(pool, 1, seed=2)
    page = pool.get_data_page(int(src[0]), flat=True).clone()
    assert backend.exists("f0" * 32) is False
    assert backend.get("f0" * 32, pool.get_dummy_flat_data_page()) is None
    assert backend.set("f0" * 32, page) is True
    assert backend.exists("f0" * 32) is True
    target = pool.get_dummy_flat_data_page()
    got = backend.get("f0" * 32, target)
    assert got is target and torch.equal(target.view(torch.uint8), page.view(torch.uint8))
    assert backend.batch_set(["f1" * 32], [page]) is True
    out = backend.batch_get(["f1" * 32, "f9" * 32], [pool.get_dummy_flat_data_page()] * 2)
    assert out[0] is not None and out[1] is None


def test_pages_survive_a_new_instance_through_the_disk_tier(
        make_backend: Callable[..., Any], tmp_path: Path) -> None:
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}
    pool = host_pool("mha", "page_first")
    first = make_backend(pool, **disk)
    src = fill_pages(pool, 3, seed=3)
    assert all(first.batch_set_v1(KEYS, src))
    first.close()  # drains the background disk writes

    second = make_backend(pool, local_cpu=False, **disk)
    assert second.batch_exists(KEYS) == 3
    dst = pool.alloc(3 * PAGE)
    assert second.batch_get_v1(KEYS, dst) == [True] * 3
    assert page_bytes(pool, dst, 3) == page_bytes(pool, src, 3)


def test_mla_pages_are_written_by_rank_zero_only(make_backend: Callable[..., Any],
                                                 tmp_path: Path) -> None:
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}
    pool = host_pool("mla", "layer_first")
    rank1 = make_backend(pool, is_mla=True, tp_rank=1, tp_size=2, **disk)
    src = fill_pages(pool, 2, seed=4)
    # Success for SGLang (rank 0 writes the replicated KV), but nothing stored by rank 1.
    assert rank1.batch_set_v1(KEYS[:2], src) == [True, True]
    assert rank1.batch_exists(KEYS[:2]) == 0

    rank0 = make_backend(pool, is_mla=True, tp_rank=0, tp_size=2, **disk)
    assert rank0.batch_set_v1(KEYS[:2], src) == [True, True]
    rank0.close()
    # MLA keys carry no rank: rank 1 reads what rank 0 wrote.
    assert rank1.batch_exists(KEYS[:2]) == 2
