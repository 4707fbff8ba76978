"""The HiCache L3 contract of `KVTierHiCacheStorage`, built the way SGLang builds it
(`StorageBackendFactory.create_backend("dynamic", ...)`), against real host pools on CPU, and
its model identity: the radix-cache backend's, from SGLang's server args (issue 36)."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.errors import ConfigError
from tests.gpu import cuda
from tests.integration.sglang.conftest import write_config

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("sglang_parallel_context")]

PAGE = 4


def storage_class() -> type:
    """kvtier's HiCache backend (a subclass of SGLang's: imported when a test runs, so the
    module is collected without SGLang)."""
    from kvtier.integration.sglang.hicache.storage import KVTierHiCacheStorage

    return KVTierHiCacheStorage


def extra_info(**kwargs: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(**kwargs)


# Pinned host pools live as long as the process: SGLang registers their pages with CUDA and
# never unregisters them, so a freed pool's address range, reused by the next one, would be
# refused as "already registered" (seen on an H100).
_PINNED: list[Any] = []


def host_pool(kind: str, layout: str, device: str = "cpu") -> Any:
    """A device pool and its HiCache host mirror: on a CPU server the mirror is pageable, on a
    GPU server (`device="cuda"`) it is pinned, as SGLang allocates it there."""
    pool = _host_pool(kind, layout, device)
    if device == "cuda":
        _PINNED.append(pool)
    return pool


def _host_pool(kind: str, layout: str, device: str) -> Any:
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


SERVED = "org/tiny-model"


def publish(monkeypatch: pytest.MonkeyPatch, server_args: Any) -> Any:
    """`server_args` as the SGLang server args of this process (a scheduler publishes them
    before it builds its cache); None: none published."""
    def get_server_args() -> Any:
        if server_args is None:
            raise ValueError("Global server args is not set yet!")
        return server_args

    monkeypatch.setattr("sglang.srt.runtime_context.get_server_args", get_server_args)
    return server_args


def server_args(model: Path, served: str | None = SERVED) -> Any:
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=str(model), served_model_name=served, device="cpu")


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> Any:
    """The server args of a text model, published in this process."""
    return publish(monkeypatch, server_args(tiny_llama))


@pytest.fixture
def make_backend(tmp_path: Path, published: Any) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(pool: Any, *, is_mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
             extra: dict[str, Any] | None = None, **config: Any) -> Any:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        cfg = write_config(tmp_path / f"kvtier-{len(made)}.yaml", **config)
        storage_config = HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=is_mla, enable_storage_metrics=False,
            is_page_first_layout=pool.layout == "page_first", model_name="org/tiny-model",
            extra_config={"backend_name": "kvtier",
                          "module_path": "kvtier.integration.sglang.hicache.storage",
                          "class_name": "KVTierHiCacheStorage", "interface_v1": 1,
                          "kvtier_config_file": str(cfg), **(extra or {})})
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
    assert second.pages.arena_bytes_used() == 0  # no CPU tier: nothing kept staged


def test_verification_recomputes_then_compares_pages_set_again(
        make_backend: Callable[..., Any], tmp_path: Path) -> None:
    """HiCache L3 mode: a query sampled for shadow verification finds nothing, so SGLang
    computes the pages and backs them up; the backup compares them with the records first."""
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}
    pool = host_pool("mha", "layer_first")
    writer = make_backend(pool, **disk)
    src = fill_pages(pool, 3, seed=5)
    assert all(writer.batch_set_v1(KEYS, src))
    writer.close()  # its disk writes drained
    checker = make_backend(pool, verify_fraction=1.0, **disk)
    assert checker.batch_exists(KEYS) == 0  # sampled: computed, not loaded
    assert all(checker.batch_set_v1(KEYS, src))  # the same pages: they match the records
    stats = checker.get_stats()
    assert stats["disk.verify_checked"] == 3 and stats["disk.verify_mismatch"] == 0
    # A backup whose second page is not what the records hold (a writer bug)
    wrong = torch.cat([src[:PAGE], fill_pages(pool, 1, seed=6), src[2 * PAGE:3 * PAGE]])
    assert all(checker.batch_set_v1(KEYS, wrong))
    stats = checker.get_stats()
    assert stats["disk.verify_mismatch"] == 1 and stats["cpu.verify_mismatch"] == 1
    dst = pool.alloc(3 * PAGE)  # removed, then stored fresh: the pages this backup sent
    assert checker.batch_get_v1(KEYS, dst) == [True, True, True]
    assert page_bytes(pool, dst, 3) == page_bytes(pool, wrong, 3)


def test_the_attach_routes_extra_config_sets_the_verified_share(
        make_backend: Callable[..., Any], tmp_path: Path) -> None:
    """SGLang's `PUT /hicache/storage-backend` builds the backend again with the extra config
    it was sent: its `verify_fraction` replaces the file's, so an operator changes the share
    while the server runs; a bad one refuses the attach, naming the key."""
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}
    pool = host_pool("mha", "layer_first")
    writer = make_backend(pool, **disk)
    assert all(writer.batch_set_v1(KEYS, fill_pages(pool, 3, seed=7)))
    writer.close()
    assert make_backend(pool, **disk).batch_exists(KEYS) == 3  # the file's share: 0
    checker = make_backend(pool, extra={"verify_fraction": 1}, verify_fraction=0.0, **disk)
    assert checker.pages.verify_fraction == 1.0
    assert checker.batch_exists(KEYS) == 0  # every query sampled: computed, then compared
    off = make_backend(pool, extra={"verify_fraction": 0}, verify_fraction=1.0, **disk)
    assert off.batch_exists(KEYS) == 3
    for bad in (1.5, "often", None):
        with pytest.raises(ConfigError, match="hicache_storage_backend_extra_config: "
                                              "verify_fraction"):
            make_backend(pool, extra={"verify_fraction": bad}, **disk)


def test_a_tail_scope_is_named_in_a_warning_and_queries_are_verified_in_full(
        make_backend: Callable[..., Any], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """HiCache asks about pages, never a request with a hit to cut: `verify_scope: tail` has
    nothing to act on there, so the backend says so and verifies a sampled query in full."""
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}
    pool = host_pool("mha", "layer_first")
    writer = make_backend(pool, **disk)
    assert all(writer.batch_set_v1(KEYS, fill_pages(pool, 3, seed=8)))
    writer.close()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        checker = make_backend(pool, verify_fraction=1.0, verify_scope="tail", **disk)
    assert "verify_scope tail applies to --enable-kvtier" in caplog.text
    assert checker.batch_exists(KEYS) == 0  # sampled: every page computed, none loaded


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


# ---- the model identity (issue 36): the radix-cache backend's, or no start ----


def test_pages_are_keyed_by_the_radix_cache_backends_model_identity(
        make_backend: Callable[..., Any], published: Any) -> None:
    from kvtier.integration.sglang.launch.identity import (
        model_fingerprint,
        model_identity,
        model_key_name,
    )

    backend = make_backend(host_pool("mha", "layer_first"))
    model = model_key_name(SERVED, model_fingerprint(published))  # as build_radix_cache keys
    assert backend._space.model == model == model_identity(published)
    assert backend._space.layout.startswith("hicache-layer_first-mha-")
    key = backend._keys(KEYS[:1])[0].key
    assert f"/{model}/hicache-layer_first-" in key and "org%2Ftiny-model@" in key


def test_other_weights_under_the_same_served_name_share_no_pages(
        make_backend: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, tiny_llama: Path,
        tmp_path: Path) -> None:
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}
    pool = host_pool("mha", "page_first")
    first = make_backend(pool, **disk)
    assert all(first.batch_set_v1(KEYS, fill_pages(pool, 3, seed=5)))
    first.close()

    # Another checkpoint served under the same name: its config differs.
    other = tmp_path / "other-model"
    shutil.copytree(tiny_llama, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    publish(monkeypatch, server_args(other))
    assert make_backend(pool, local_cpu=False, **disk).batch_exists(KEYS) == 0

    publish(monkeypatch, server_args(tiny_llama))  # the first model again: its pages are there
    assert make_backend(pool, local_cpu=False, **disk).batch_exists(KEYS) == 3


def test_no_start_without_server_args_to_fingerprint_the_model(
        make_backend: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.errors import ConfigError

    publish(monkeypatch, None)
    with pytest.raises(ConfigError, match="server args are not published.*fingerprint"):
        make_backend(host_pool("mha", "layer_first"))


def test_no_start_for_a_model_served_with_multimodal_input(
        make_backend: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """HiCache hands its L3 page hashes only, so multimodal requests cannot bypass kvtier one
    by one as on the radix-cache path: such a model is refused (hicache_storage docstring)."""
    from kvtier.errors import ConfigError

    vl = tmp_path / "tiny-vl"
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 512, "torch_dtype": "float32", "bos_token_id": 0,
        "eos_token_id": 1, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "vision_config": {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                          "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2}}))
    publish(monkeypatch, server_args(vl))
    with pytest.raises(ConfigError, match="multimodal input.*--enable-kvtier"):
        make_backend(host_pool("mha", "layer_first"))


def test_no_start_when_sglang_cannot_say_whether_the_model_is_multimodal(
        make_backend: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    from kvtier.errors import ConfigError

    publish(monkeypatch, SimpleNamespace(model_path=str(tmp_path / "no-such-model")))
    with pytest.raises(ConfigError, match="cannot tell whether model .* multimodal"):
        make_backend(host_pool("mha", "layer_first"))
