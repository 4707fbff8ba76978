"""LMCache config files in kvtier: the corpus in tests/lmcache_configs loads with the documented
warnings (or fails naming the key), and kvtier then does what the warnings say."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvtier.config import Config, load_config, load_config_report
from kvtier.config_checks import TRANSFER_ARENA_GB
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError
from kvtier.lmcache_compat import UNIMPLEMENTED, instead_of
from tests.conftest import RedisProcess
from tests.helpers import same_bytes

CORPUS = Path(__file__).resolve().parent / "lmcache_configs"
SLOTS = 1024

# file -> (tiers, LMCache keys reported as not implemented, keys whose values are translated)
LOADS: dict[str, tuple[tuple[str, ...], set[str], set[str]]] = {
    "cpu_layerwise.yaml": (("cpu",), {"use_layerwise", "enable_async_loading"}, set()),
    "cpu_disk_strings.yaml": (("cpu", "disk"), {"save_decode_cache", "cache_policy",
                                                "py_enable_gc", "pre_caching_hash_algorithm",
                                                "local_disk_path_sharding"}, set()),
    "disk_only_no_cpu.yaml": (("disk",), set(), {"remote_serde", "max_local_cpu_size"}),
    "resp_remote.yaml": (("redis",), {"extra_config", "extra_config.resp_num_threads",
                                      "extra_config.save_chunk_meta"},
                         {"remote_url", "extra_config", "max_local_cpu_size"}),
    "redis_cachegen.yaml": (("cpu", "redis"), {"enable_controller", "lmcache_instance_id",
                                               "controller_pull_url", "controller_reply_url",
                                               "lmcache_worker_ports"}, {"remote_serde"}),
    "pd_sender_with_remote.yaml": (("redis",), {"enable_pd", "transfer_channel", "pd_role",
                                                "pd_proxy_host", "pd_proxy_port",
                                                "pd_buffer_size", "pd_buffer_device",
                                                "nixl_backends"},
                                   {"remote_serde", "max_local_cpu_size"}),
    "v0_legacy.yaml": (("cpu", "redis"), {"local_device", "pipelined_backend"},
                       {"remote_serde"}),
    "blend_p2p.yaml": (("cpu",), {"enable_blending", "blend_special_str",
                                  "blend_recompute_ratios", "enable_p2p", "p2p_host",
                                  "p2p_init_ports", "p2p_lookup_ports", "enable_controller",
                                  "lmcache_instance_id", "controller_pull_url",
                                  "controller_reply_url", "lmcache_worker_ports",
                                  "internal_api_server_enabled", "numa_mode"}, set()),
}
# file -> (the key the error names, a phrase of the message)
FAILS: dict[str, tuple[str, str]] = {
    "pd_receiver_only.yaml": ("local_cpu", "no tier enabled"),
    "gds_only.yaml": ("local_cpu", "no tier enabled"),
    "mooncake.yaml": ("remote_url", "cannot serve mooncakestore://"),
    "lm_server.yaml": ("remote_url", "cannot serve lm://"),
    "s3.yaml": ("remote_url", "cannot serve s3://"),
    "external.yaml": ("remote_url", "cannot serve external://"),
    "multi_disk.yaml": ("local_disk", "several disks"),
    "typo_async_loading.yaml": ("async_loading", "did you mean 'enable_async_loading'"),
}


def test_every_corpus_file_has_an_expectation() -> None:
    files = {p.name for p in CORPUS.glob("*.yaml")}
    assert files == set(LOADS) | set(FAILS)


@pytest.mark.parametrize("name", sorted(LOADS))
def test_corpus_loads_with_one_warning_listing_what_kvtier_does_instead(
    name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    tiers, ignored, translated = LOADS[name]
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(CORPUS / name, env={})
    assert cfg.tiers == tiers
    report = load_config_report(CORPUS / name, env={})
    assert {k for k, _ in report.ignored} == ignored
    assert {k for k, _ in report.notes} == translated
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if not ignored and not translated:
        assert warnings == []
        return
    assert len(warnings) == 1
    for key in ignored:
        assert f"  {key}: " in warnings[0]
        if key in UNIMPLEMENTED:
            assert UNIMPLEMENTED[key] in warnings[0]
    for key in translated:
        assert f"  {key}: " in warnings[0]
    assert "kvpass" not in warnings[0]


@pytest.mark.parametrize("name", sorted(FAILS))
def test_corpus_errors_name_the_key(name: str) -> None:
    key, phrase = FAILS[name]
    with pytest.raises(ConfigError) as err:
        load_config(CORPUS / name, env={})
    msg = str(err.value)
    assert name in msg and f": {key}: " in msg and phrase in msg


def test_every_ignored_key_says_what_kvtier_does_instead() -> None:
    for key in ("use_layerwise", "enable_async_loading", "save_decode_cache", "extra_config",
                "local_device", "pipelined_backend", "enable_pd", "pd_role", "nixl_role",
                "enable_p2p", "p2p_host", "lookup_url", "distributed_url", "enable_controller",
                "controller_url", "lmcache_instance_id", "blend_thresholds", "enable_blending",
                "cache_policy", "numa_mode", "external_lookup_client", "priority_limit",
                "min_retrieve_tokens", "internal_api_server_port_start", "plugin_locations",
                "use_gds", "gds_path", "weka_path", "cufile_buffer_size",
                "audit_actual_remote_url", "error_handling", "remote_storage_plugins",
                "storage_plugins", "py_enable_gc", "cache_engine_args", "remote_config_url"):
        assert instead_of(key), key
    assert instead_of("chunk_size") is None and instead_of("no_such_key") is None


def test_ignored_keys_change_nothing(tmp_path: Path) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 2\n")
    assert load_config(CORPUS / "cpu_layerwise.yaml", env={}) == load_config(plain, env={})
    assert load_config(CORPUS / "blend_p2p.yaml", env={}) == Config(
        max_local_cpu_size=2.0, save_unfull_chunk=True)


# ---- behaviour after loading --------------------------------------------------------------

def _pool(seed: int) -> SGLangMHAConnector:
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randint(-100, 100, (SLOTS, 2, 8), generator=gen).half() for _ in range(2)]
    v = [torch.randint(-100, 100, (SLOTS, 2, 8), generator=gen).half() for _ in range(2)]
    return SGLangMHAConnector(k, v)


def _round_trip(cfg: Config) -> tuple[CacheEngine, SGLangMHAConnector]:
    """Store 512 tokens from one pool, load them into another through a second engine."""
    src, dst = _pool(1), _pool(2)
    tokens = list(range(1000, 1512))
    slots = torch.arange(512)
    writer = CacheEngine(cfg, model_name="m", layout=src.layout, connector=src)
    assert writer.store(tokens, slots) == 512
    writer.close()  # drains the background writes to disk/Redis
    reader = CacheEngine(cfg, model_name="m", layout=dst.layout, connector=dst)
    assert reader.retrieve(tokens, slots) == 512
    for a, b in zip(src._layers, dst._layers, strict=True):
        assert same_bytes(a[:512], b[:512])
    return reader, src


def _with_port(name: str, tmp_path: Path, port: int) -> Path:
    path = tmp_path / name
    path.write_text((CORPUS / name).read_text().replace("localhost:6379", f"127.0.0.1:{port}"))
    return path


def test_resp_url_and_extra_config_credentials_reach_redis(
    redis_auth_server: RedisProcess, tmp_path: Path,
) -> None:
    # The server refuses clients without kvuser/kvpass: a round trip proves they were used.
    redis_auth_server.client().flushall()
    cfg = load_config(_with_port("resp_remote.yaml", tmp_path, redis_auth_server.port), env={})
    assert cfg.remote_url is not None and cfg.remote_url.startswith("redis://kvuser:kvpass@")
    reader, _ = _round_trip(cfg)
    try:
        stats = reader.stats()
        assert not any(k.startswith("cpu") for k in stats)  # local_cpu: false: no CPU tier
        # ... but a transfer arena of the size the warning names
        assert reader.storage.allocator.size == pytest.approx(TRANSFER_ARENA_GB * 1e9, rel=1e-3)
    finally:
        reader.close()
    assert redis_auth_server.client().dbsize() == 2


def test_cachegen_serde_stores_raw_records(redis_server: RedisProcess, tmp_path: Path) -> None:
    redis_server.client().flushall()
    cfg = load_config(_with_port("redis_cachegen.yaml", tmp_path, redis_server.port), env={})
    assert cfg.remote_serde == "naive"
    reader, src = _round_trip(cfg)
    reader.close()
    client = redis_server.client()
    values = [client.get(k) for k in client.keys("*")]
    raw_k0 = src._layers[0][:256].numpy().tobytes()  # chunk 0, layer 0 K, uncompressed
    assert any(raw_k0 in v for v in values)


def test_no_cpu_config_uses_disk_through_a_transfer_arena(tmp_path: Path) -> None:
    env = {"KVTIER_LOCAL_DISK": str(tmp_path / "disk")}
    cfg = load_config(CORPUS / "disk_only_no_cpu.yaml", env=env)
    assert cfg.tiers == ("disk",) and cfg.max_local_cpu_size == TRANSFER_ARENA_GB
    reader, _ = _round_trip(cfg)
    reader.close()
    assert len(list((tmp_path / "disk").glob("*/*/*.kvt"))) == 2
