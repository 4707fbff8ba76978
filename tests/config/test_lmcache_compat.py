"""LMCache config files in kvtier: the corpus in tests/lmcache_configs loads with the documented
warnings (or fails naming the key), and kvtier then does what the warnings say."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from harness.redis import RedisProcess
from kvtier.cli import main
from kvtier.config import Config, is_config_key, load_config, load_config_report
from kvtier.config.host import check_host, memory_problem, physical_memory_bytes
from kvtier.config.lmcache.compat import (
    KEYS,
    NOT_LMCACHE,
    UNIMPLEMENTED,
    UNSUPPORTED,
    UNSUPPORTED_SCHEMES,
    classify,
    instead_of,
    unsupported_storage,
)
from kvtier.config.lmcache.keys import PREFIXES, STATUSES
from kvtier.config.lmcache.migrate import explain
from kvtier.config.schema import TRANSFER_ARENA_GB
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError
from tests.helpers import same_bytes

CORPUS = Path(__file__).resolve().parents[1] / "lmcache_configs"
SLOTS = 1024

# Every top-level key the config modules of LMCache 0.3.0 ... 0.5.6 (PyPI sdists) define: the
# v1 `lmcache/v1/config.py` and the v0 `lmcache/config.py` they still shipped.
RELEASED_KEYS = """
    app_id audit_actual_remote_url blend_add_special_in_precomp blend_check_layers
    blend_min_tokens blend_recompute_ratio blend_recompute_ratios blend_separator
    blend_special_str blend_thresholds blocking_timeout_secs cache_policy chunk_size
    chunk_statistics_auto_exit_target_unique_chunks chunk_statistics_auto_exit_timeout_hours
    chunk_statistics_auto_start_statistics chunk_statistics_strategy controller_pull_url
    controller_reply_url controller_url cufile_buffer_size distributed_url enable_async_loading
    enable_blending enable_chunk_statistics enable_controller enable_hidden_state_cache
    enable_kv_events enable_lazy_memory_allocator enable_nixl enable_p2p enable_pd
    enable_scheduler_bypass_lookup enable_xpyd error_handling external_backends
    external_lookup_client extra_config gds_backend gds_buffer_size gds_path gds_path_sharding
    hidden_state_layers hidden_states_retrieve_mode hit_miss_ratio internal_api_server_enabled
    internal_api_server_host internal_api_server_include_index_list
    internal_api_server_port_start internal_api_server_socket_path_prefix
    lazy_memory_expand_trigger_ratio lazy_memory_initial_ratio lazy_memory_safe_size
    lazy_memory_step_ratio lmcache_instance_id lmcache_worker_heartbeat_delay_time
    lmcache_worker_heartbeat_time lmcache_worker_ids lmcache_worker_port lmcache_worker_ports
    local_cpu local_cpu_use_hugepages local_device local_disk local_disk_path_sharding
    lookup_server_worker_ids lookup_timeout_ms lookup_url maru_path maru_pool_size
    max_hidden_state_cpu_size max_local_cache_size max_local_cpu_size max_local_disk_size
    min_retrieve_tokens mla_lookup_server_worker_id mp_host mp_port nixl_backends
    nixl_buffer_device nixl_buffer_size nixl_enable_gc nixl_peer_alloc_port nixl_peer_host
    nixl_peer_init_port nixl_peer_port nixl_proxy_host nixl_proxy_port nixl_receiver_host
    nixl_receiver_port nixl_role numa_mode p2p_host p2p_init_ports p2p_lookup_ports
    pd_allocation_timeout_sec pd_backend_mode pd_bidirectional pd_buffer_device pd_buffer_size
    pd_condition_poll_interval_sec pd_max_prefill_len pd_peer_alloc_port pd_peer_host
    pd_peer_init_port pd_peer_query_port pd_proxy_host pd_proxy_port pd_role
    pd_shutdown_timeout_sec pd_skip_proxy_notification pin_check_interval_sec pin_timeout_sec
    pipelined_backend plugin_locations pre_caching_hash_algorithm priority_limit py_enable_gc
    remote_config_url remote_serde remote_storage_plugins remote_url reserve_local_cpu_size
    retrieve_locations run_script_api_enabled runtime_plugin_locations save_decode_cache
    save_unfull_chunk script_allowed_imports storage_plugins store_location transfer_channel
    use_gds use_gpu_connector_v3 use_layerwise weka_path
""".split()
# Unsupported keys that hold a size, never a place KV is kept: they never refuse a file.
NEVER_STORAGE = {"max_local_cache_size"}
# An alternative named by every "not supported" line (a key to use, or what to drop).
ALTERNATIVE = ("use ", "drop ", "keep ", "share KV", "redis://")

# file -> (tiers, LMCache keys in the load warning, keys whose values are translated)
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
    "v0_disk_device.yaml": (("cpu",), {"local_device", "max_local_cache_size",
                                       "pipelined_backend", "save_decode_cache",
                                       "blend_recompute_ratio", "blend_separator",
                                       "blend_add_special_in_precomp"}, {"remote_serde"}),
    "blend_p2p.yaml": (("cpu",), {"enable_p2p", "p2p_host",
                                  "p2p_init_ports", "p2p_lookup_ports", "enable_controller",
                                  "lmcache_instance_id", "controller_pull_url",
                                  "controller_reply_url", "lmcache_worker_ports",
                                  "internal_api_server_enabled", "numa_mode"}, set()),
    "big_host_cpu.yaml": (("cpu",), set(), set()),
    "example_async_loading.yaml": (("cpu",), {"async_loading"}, set()),
    "lmcache_05_full.yaml": (("cpu", "disk"), set(), set()),  # ignored: every other key
    "sglang_disk_relative.yaml": (("cpu", "disk"), {"use_layerwise"}, set()),
}
# file -> (the key the load error names, a phrase of the message, the key `migrate-config`
# names as the file's storage, or None where the error names it already)
FAILS: dict[str, tuple[str, str, str | None]] = {
    "pd_receiver_only.yaml": ("local_cpu", "does not do PD transfer", "enable_nixl"),
    "gds_only.yaml": ("local_cpu", "use local_disk", "gds_path"),
    "weka_only.yaml": ("local_cpu", "use local_disk", "weka_path"),
    "nixl_storage.yaml": ("local_cpu", "no tier enabled", "extra_config.enable_nixl_storage"),
    "mooncake.yaml": ("remote_url", "cannot serve mooncakestore://", None),
    "lm_server.yaml": ("remote_url", "cannot serve lm://", None),
    "s3.yaml": ("remote_url", "cannot serve s3://", None),
    "external.yaml": ("remote_url", "cannot serve external://", None),
    "multi_disk.yaml": ("local_disk", "several disks", None),
    "typo_disk_path.yaml": ("disk_path", "unknown key", None),
    "vllm_disagg_flag.yaml": ("enable_disagg_prefill", "unknown key", None),
}


def test_every_corpus_file_has_an_expectation() -> None:
    files = {p.name for p in CORPUS.glob("*.yaml")}
    assert files == set(LOADS) | set(FAILS)


@pytest.mark.parametrize("name", sorted(LOADS))
def test_corpus_loads_with_one_warning_listing_what_kvtier_does_instead(
    name: str, caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiers, ignored, translated = LOADS[name]
    monkeypatch.chdir(tmp_path)  # where a relative local_disk resolves, as LMCache's would
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(CORPUS / name, env={})
    assert cfg.tiers == tiers
    relative = [r.getMessage() for r in caplog.records if r.name == "kvtier.config.paths"]
    assert len(relative) == (name == "sglang_disk_relative.yaml")  # LMCache: ./local_disk/
    if relative:  # one warning, naming the directory
        assert cfg.local_disk_path == tmp_path / "local_disk"
        assert f" {cfg.local_disk_path} " in relative[0]
    report = load_config_report(CORPUS / name, env={})
    if name == "lmcache_05_full.yaml":  # every LMCache key that is not a kvtier key
        data = yaml.safe_load((CORPUS / name).read_text())
        ignored = {k for k in data if not is_config_key(k)}
    assert {k for k, _ in report.ignored} == ignored
    assert {k for k, _ in report.notes} == translated
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvtier.config.load"]
    if not ignored and not translated:
        assert warnings == []
        return
    assert len(warnings) == 1
    for key in ignored:
        assert f"  {key}: " in warnings[0]
        if classify(key) is not None:
            assert f"  {key}: {instead_of(key)}\n" in warnings[0] + "\n"
    for key in translated:
        assert f"  {key}: " in warnings[0]
    assert "kvpass" not in warnings[0]


@pytest.mark.parametrize("name", sorted(FAILS))
def test_corpus_errors_name_the_key_and_what_to_use(name: str) -> None:
    key, phrase, storage = FAILS[name]
    with pytest.raises(ConfigError) as err:
        load_config(CORPUS / name, env={})
    msg = str(err.value)
    assert name in msg and f": {key}: " in msg and phrase in msg
    assert any(alt in msg for alt in ("use ", "redis://", "local_disk", "did you mean",
                                      "valid keys"))
    # migrate-config: the same error, then the key the file keeps its KV in, with what to use
    migration = explain(CORPUS / name)
    assert migration.loaded is None and migration.error is not None
    assert migration.error.startswith(msg)
    rows = {r.key: r for r in migration.rows}
    if storage is not None:
        assert f"[this file keeps its KV in {storage}: not supported: " in migration.error
        assert rows[storage].kind == "unsupported"
        assert any(alt in rows[storage].note for alt in ALTERNATIVE)
    if key not in ("local_cpu", "local_disk"):
        assert rows[key].kind in ("unsupported", "unknown")


def test_corpus_storage_kvtier_has_loads() -> None:
    """The files whose storage kvtier has (CPU, disk, Redis) all load (13 of 13); those that
    fail use storage kvtier does not have, or a key no LMCache version had."""
    storage_kvtier_lacks = {n for n, (_, _, storage) in FAILS.items() if storage}
    storage_kvtier_lacks |= {"mooncake.yaml", "lm_server.yaml", "s3.yaml", "external.yaml",
                             "multi_disk.yaml"}
    not_lmcache = {"typo_disk_path.yaml", "vllm_disagg_flag.yaml"}
    assert set(FAILS) == storage_kvtier_lacks | not_lmcache
    assert len(LOADS) == 13 and "sglang_disk_relative.yaml" in LOADS


# ---- the table ----------------------------------------------------------------------------

def test_table_classifies_every_key_of_every_release() -> None:
    assert len(KEYS) >= len(RELEASED_KEYS) == 136
    for key in RELEASED_KEYS:
        assert classify(key) is not None, key
    for key, entry in [*KEYS.items(), *PREFIXES.items()]:
        assert entry.status in STATUSES, key
        assert entry.note and "\n" not in entry.note and entry.versions, key
        assert entry.note.startswith({"same": "same key", "ignored": "ignored: ",
                                      "unsupported": "not supported: "}[entry.status]), key
        if entry.status == "unsupported":
            assert any(alt in entry.note for alt in ALTERNATIVE), key
    assert {k for k, e in KEYS.items() if e.status == "same"} == {
        k for k in KEYS if is_config_key(k)}
    assert set(UNIMPLEMENTED) | set(UNSUPPORTED) == {
        k for k, e in KEYS.items() if e.status != "same"}
    for scheme, instead in UNSUPPORTED_SCHEMES.items():
        assert any(alt in instead for alt in ("redis://", "local_disk", "drop remote_url")), scheme


def test_docs_list_every_key_of_the_table() -> None:
    text = (CORPUS.parent.parent / "docs" / "lmcache.md").read_text()
    for key, entry in KEYS.items():
        assert f"`{key}` ({entry.versions})" in text, key
        assert entry.status == "same" or entry.note in text, key
    assert all(f"`{prefix}*`" in text for prefix in PREFIXES)
    assert all(f"`{scheme}://`" in text for scheme in UNSUPPORTED_SCHEMES)


def test_instead_of_covers_the_lmcache_keys_only() -> None:
    assert instead_of("chunk_size") is None and instead_of("no_such_key") is None
    assert instead_of("cache_engine_args") is None  # no LMCache version had it
    assert instead_of("pd_future_knob") == KEYS["enable_pd"].note  # a family's new member
    for key in NOT_LMCACHE:
        assert classify(key) is None, key


@pytest.mark.parametrize("key", sorted(set(UNIMPLEMENTED) | set(UNSUPPORTED)))
def test_each_lmcache_key_loads_with_its_warning_line(key: str, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"chunk_size: 256\nmax_local_cpu_size: 1\n{key}: "
                    f"{'{}' if key == 'extra_config' else 'true'}\n")
    report = load_config_report(path, env={})
    assert report.config.tiers == ("cpu",)
    assert (key, KEYS[key].note) in report.ignored
    warning = report.warning()
    assert warning is not None and f"  {key}: {KEYS[key].note}" in warning
    [row] = [r for r in explain(path).rows if r.key == key]  # migrate-config says the same
    assert (row.kind, row.note) == (KEYS[key].status, KEYS[key].note)


@pytest.mark.parametrize("key", sorted(set(UNSUPPORTED) - NEVER_STORAGE))
def test_each_unsupported_key_as_the_only_storage_is_refused(key: str, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"local_cpu: false\nmax_local_cpu_size: 0\n{key}: true\n")
    with pytest.raises(ConfigError, match=r": local_cpu: no tier enabled") as err:
        load_config(path, env={})
    assert "redis://" in str(err.value) and "local_disk" in str(err.value)
    assert unsupported_storage(yaml.safe_load(path.read_text())) == (key, KEYS[key].note)
    error = explain(path).error
    assert error is not None and f"[this file keeps its KV in {key}: {KEYS[key].note}]" in error


def test_unsupported_storage_needs_the_feature_on_and_no_kvtier_tier() -> None:
    assert unsupported_storage({"local_cpu": False, "gds_path": "/mnt/x"}) == (
        "gds_path", KEYS["gds_path"].note)
    assert unsupported_storage({"local_cpu": "False", "enable_pd": "True"}) == (
        "enable_pd", KEYS["enable_pd"].note)
    assert unsupported_storage({"gds_path": "/mnt/x"}) is None  # the CPU tier is left
    assert unsupported_storage({"local_cpu": False, "local_disk": "/d", "enable_pd": True}) is None
    assert unsupported_storage({"local_cpu": False, "enable_pd": False, "gds_path": None}) is None
    assert unsupported_storage({"local_cpu": False, "max_local_cache_size": 5}) is None


@pytest.mark.parametrize("key, alternative", [
    ("enable_async_load", "enable_async_loading"), ("disk_path", "local_disk"),
    ("enable_disagg_prefill", "does not do PD transfer"), ("chunk_sise", "chunk_size"),
    ("cache_engine_args", "docs/lmcache.md"),
])
def test_keys_no_lmcache_version_had_are_errors_naming_the_alternative(
    key: str, alternative: str, tmp_path: Path,
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"chunk_size: 256\n{key}: true\n")
    with pytest.raises(ConfigError, match=rf": {key}: unknown key"):
        load_config(path, env={})
    [row] = [r for r in explain(path).rows if r.key == key]
    assert row.kind == "unknown" and alternative in row.note


def test_migrate_config_prints_the_classification(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate-config", str(CORPUS / "blend_p2p.yaml")]) == 0
    kinds = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()
             if line and not line.startswith("#") and ":" not in line.split()[0]}
    assert kinds["chunk_size"] == "kvtier" and kinds["enable_blending"] == "kvtier"
    assert kinds["enable_p2p"] == "unsupported" and kinds["p2p_host"] == "unsupported"
    assert main(["migrate-config", str(CORPUS / "weka_only.yaml")]) == 2
    captured = capsys.readouterr()
    assert "weka_path" in captured.out and "unsupported" in captured.out
    assert "keeps its KV in weka_path" in captured.err and "use local_disk" in captured.err


def test_ignored_keys_change_nothing(tmp_path: Path) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 2\n")
    assert load_config(CORPUS / "cpu_layerwise.yaml", env={}) == load_config(plain, env={})
    assert load_config(CORPUS / "blend_p2p.yaml", env={}) == Config(
        max_local_cpu_size=2.0, save_unfull_chunk=True, enable_blending=True)


# ---- a file sized for a bigger host -------------------------------------------------------

def test_arena_larger_than_this_host_warns_in_check_config_and_fails_at_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "big.yaml"
    size = round(physical_memory_bytes() * 2 / 1e9, 1)  # twice this host, whatever it has
    path.write_text(f"local_cpu: true\nmax_local_cpu_size: {size}\n")
    cfg = load_config(path, env={})  # valid: the file may be meant for a bigger host
    assert main(["check-config", str(path)]) == 1
    out, err = capsys.readouterr()
    assert f"problem: on this host, max_local_cpu_size: {size:g} GB" in err
    assert "max_local_cpu_size" in yaml.safe_load(out)["launch_problems"][0]
    with pytest.raises(ConfigError, match=rf"^max_local_cpu_size: {size:g} GB x 1 local rank"):
        check_host(cfg)  # what the launch calls before any worker starts
    big = load_config(CORPUS / "big_host_cpu.yaml", env={})  # the corpus file: 4096 GB
    assert (memory_problem(big) is not None) == (physical_memory_bytes() < 4097e9)  # +headroom


# ---- behaviour after loading --------------------------------------------------------------

def _pool(seed: int) -> tuple[SGLangMHAConnector, list[torch.Tensor]]:
    """A connector over a random pool, and the pool's layers (K of each layer, then V)."""
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randint(-100, 100, (SLOTS, 2, 8), generator=gen).half() for _ in range(2)]
    v = [torch.randint(-100, 100, (SLOTS, 2, 8), generator=gen).half() for _ in range(2)]
    return SGLangMHAConnector(k, v), k + v


def _round_trip(cfg: Config, exact: bool = True) -> tuple[CacheEngine, list[torch.Tensor]]:
    """Store 512 tokens from one pool, load them into another through a second engine (the
    same bytes, or with `exact` false within fp8's 6% relative L2 error per layer); returns
    the reader and the source pool's layers."""
    (src, src_layers), (dst, dst_layers) = _pool(1), _pool(2)
    tokens = list(range(1000, 1512))
    slots = torch.arange(512)
    writer = CacheEngine(cfg, model_name="m", layout=src.layout, connector=src)
    assert writer.store(tokens, slots) == 512
    writer.close()  # drains the background writes to disk/Redis
    reader = CacheEngine(cfg, model_name="m", layout=dst.layout, connector=dst)
    assert reader.retrieve(tokens, slots) == 512
    for a, b in zip(src_layers, dst_layers, strict=True):
        if exact:
            assert same_bytes(a[:512], b[:512])
        else:
            err = (a[:512].float() - b[:512].float()).norm() / a[:512].float().norm()
            assert 0 < err < 0.06
    return reader, src_layers


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
        assert not any(k.startswith("cpu") for k in stats), sorted(stats)  # no CPU tier
        # ... but a transfer arena of the size the warning names
        assert reader.stats()["arena_bytes"] == pytest.approx(TRANSFER_ARENA_GB * 1e9, rel=1e-3)
    finally:
        reader.close()
    assert redis_auth_server.client().dbsize() == 2


def test_no_cpu_config_uses_disk_through_a_transfer_arena(tmp_path: Path) -> None:
    env = {"KVTIER_LOCAL_DISK": str(tmp_path / "disk")}
    cfg = load_config(CORPUS / "disk_only_no_cpu.yaml", env=env)
    assert cfg.tiers == ("disk",) and cfg.max_local_cpu_size == TRANSFER_ARENA_GB
    reader, _ = _round_trip(cfg)
    reader.close()
    assert len(list((tmp_path / "disk").glob("*/*/*.kvt"))) == 2
