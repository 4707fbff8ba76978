"""Every key of every released LMCache engine config, and what kvtier does with it (data only;
`kvtier.config.lmcache.compat` applies it).

Sources: the config modules of every LMCache release on PyPI, 0.3.0 to 0.5.6
(`lmcache/v1/config.py`, its `_CONFIG_DEFINITIONS` and `_CONFIG_ALIASES` from 0.3.12 on, the
`LMCacheEngineConfig` dataclass before; and the v0 `lmcache/config.py` they still shipped up to
0.3.11); for the releases before 0.3 (not on PyPI), the GitHub history of `lmcache/config.py`
(v0) and `lmcache/experimental/config.py`; and LMCache's configuration docs
(`docs/source/api_reference/configurations.rst` of each release, `configuration/v0|v1/*.rst`),
which name two top-level keys the code never read (`peer_init_ports`, `peer_lookup_ports`).

Each key has a status:

- `same`: a kvtier key with the same meaning (a field of `kvtier.config.Config`);
- `ignored`: accepted; the load warning says why, and what kvtier does instead;
- `unsupported`: storage or transfer kvtier does not have; accepted, and the load warning says
  what to use instead. A file whose only storage it is leaves kvtier nothing to store in: that
  file is refused (`lmcache_compat.unsupported_storage` names the key).

`versions` is the first and last release that defined the key ("0.3.0-" when 0.5.6 still does;
"0.1"/"0.2" for releases before 0.3, from the GitHub history). Keys no LMCache version had are not
here: they are unknown keys (errors with the nearest valid key).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LMCacheKey", "KEYS", "PREFIXES", "STATUSES", "UNSUPPORTED_SCHEMES"]

STATUSES = ("same", "ignored", "unsupported")


@dataclass(frozen=True)
class LMCacheKey:
    """What kvtier does with one LMCache key: `status` (one of `STATUSES`), `note` (one line: why
    it is ignored and what kvtier does instead, or what to use instead), `versions` (releases
    that defined it)."""

    status: str
    note: str
    versions: str


def _same(versions: str) -> LMCacheKey:
    return LMCacheKey("same", "same key and meaning in kvtier", versions)


def _ignored(note: str, versions: str) -> LMCacheKey:
    return LMCacheKey("ignored", "ignored: " + note, versions)


def _unsupported(note: str, versions: str) -> LMCacheKey:
    return LMCacheKey("unsupported", "not supported: " + note, versions)


# Shared notes. "ignored": why, then what kvtier does instead; "not supported": what to use.
_PD = ("kvtier does not do PD (prefill-decode) transfer: drop enable_pd/pd_*/nixl_* and keep "
       "local_cpu; to reuse KV across instances give them one shared remote_url: "
       "redis://host:6379")
_P2P = ("no peer-to-peer transfer between instances: share KV through one remote_url: "
        "redis://host:6379")
_GDS = ("no GPU-direct storage tier: use local_disk: file:///path/ (with max_local_disk_size) "
        "for a file-backed tier")
_MARU = ("no CXL shared-memory tier: use local_cpu, or remote_url: redis://host:6379 to share "
         "KV between instances")
_PLUGINS = ("no storage plugins: kvtier's tiers are local_cpu, local_disk and remote_url "
            "(redis://...)")
_BLEND = ("kvtier picks tokens to recompute by share (blend_recompute_ratios), not by "
          "threshold, and never adds the separator to a segment")
_CONTROLLER = "no cache controller; `kvtier stats`, `ls` and `purge` inspect the tiers"
_LOOKUP = "no lookup service; each engine looks up its own tiers directly"
_API = "no internal API server; metrics_port serves Prometheus metrics"
_ARENA = "kvtier allocates one arena of max_local_cpu_size GB once at start-up"
_STATS = "no chunk statistics; the counters are in stats() and the metrics"
_HIDDEN = "no hidden-state cache; kvtier stores KV only"
_PIN = "kvtier pins nothing between calls (each lease ends with its copy)"
_REMOTE_CONFIG = "kvtier reads its config from the file and the environment only"
_MP = "kvtier runs inside the serving process (no LMCache MP server)"
_EC = "no encoder cache; kvtier stores KV only"

KEYS: dict[str, LMCacheKey] = {
    # ---- the keys kvtier shares with LMCache
    "chunk_size": _same("0.1-"),
    "local_cpu": _same("0.2-"),
    "max_local_cpu_size": _same("0.2-"),
    "local_disk": _same("0.2-"),
    "max_local_disk_size": _same("0.2-"),
    "remote_url": _same("0.1-"),
    "remote_serde": _same("0.1-"),
    "save_unfull_chunk": _same("0.3.1-"),
    "blocking_timeout_secs": _same("0.3.1-"),
    # ---- LMCache v0 (`lmcache/config.py`) and the v0/v1 switch
    "local_device": _unsupported("LMCache v0's cache device: use local_cpu: true for CPU, "
                                 "local_disk: file:///path/ for disk", "0.1-0.3.11"),
    "max_local_cache_size": _unsupported("LMCache v0's cache size: use max_local_cpu_size "
                                         "(GB; kvtier's default is 5)", "0.1-0.3.11"),
    "pipelined_backend": _ignored("LMCache v0 pipelining; kvtier always writes lower tiers in "
                                  "the background", "0.1-0.3.11"),
    "use_experimental": _ignored("LMCache's v0/v1 switch; kvtier has one implementation (the "
                                 "LMCACHE_USE_EXPERIMENTAL variable is ignored too)", "0.2"),
    # ---- what is stored, and how
    "save_decode_cache": _ignored("kvtier stores the tokens the serving engine passes to "
                                  "store() (SGLang: each finished request)", "0.1-"),
    "use_layerwise": _ignored("kvtier moves whole chunks, every layer in one copy (no "
                              "layer-by-layer pipelining)", "0.3.1-"),
    "enable_async_loading": _ignored("retrieve() loads synchronously; prefetch_policy loads "
                                     "lower tiers ahead", "0.3.6-"),
    "pre_caching_hash_algorithm": _ignored("chunk keys are always chained SHA-256", "0.3.3-"),
    "min_retrieve_tokens": _ignored("kvtier loads any hit of one chunk or more", "0.3.14-"),
    "priority_limit": _ignored("every request may store", "0.3.6-"),
    "retrieve_locations": _ignored("kvtier reads its tiers in the order cpu -> disk -> redis",
                                   "0.4.2-"),
    "store_location": _ignored("kvtier writes every tier, per write_policy", "0.4.2-"),
    "cache_policy": _ignored("kvtier evicts LRU by chunk, deeper chunks of a prefix first",
                             "0.3.4-"),
    "error_handling": _ignored("a tier failure is always a counted miss; serving goes on",
                               "0.2-0.3.5"),
    "extra_config": _ignored("kvtier uses only username/password (the credentials of "
                             "remote_url); each other entry is listed", "0.3.1-"),
    "audit_actual_remote_url": _ignored("no audit connector; kvtier counts tier operations in "
                                        "stats()", "0.3.0-"),
    "py_enable_gc": _ignored("kvtier leaves Python's garbage collector alone", "0.3.4-"),
    "numa_mode": _ignored("kvtier does not bind its arena to a NUMA node", "0.3.4-"),
    "use_gpu_connector_v3": _ignored("kvtier's connectors read SGLang's KV pools", "0.3.12-"),
    "enable_kv_events": _ignored("no KV event stream", "0.3.10.post2-"),
    # ---- CPU memory
    "local_cpu_use_hugepages": _ignored(_ARENA + " (regular pages, faulted in at start-up)",
                                        "0.4.6-"),
    "reserve_local_cpu_size": _ignored(_ARENA + "; the launch checks it fits the host",
                                       "0.3.9-"),
    "enable_lazy_memory_allocator": _ignored(_ARENA, "0.3.10-"),
    "lazy_memory_initial_ratio": _ignored(_ARENA, "0.3.10-"),
    "lazy_memory_expand_trigger_ratio": _ignored(_ARENA, "0.3.10-"),
    "lazy_memory_step_ratio": _ignored(_ARENA, "0.3.10-"),
    "lazy_memory_safe_size": _ignored(_ARENA, "0.3.10-"),
    "pin_timeout_sec": _ignored(_PIN, "0.3.12-"),
    "pin_check_interval_sec": _ignored(_PIN, "0.3.12-"),
    "local_disk_path_sharding": _ignored("kvtier keeps one directory; TP ranks are keyed apart "
                                         "inside it", "0.4.4-"),
    # ---- CacheBlend
    "enable_blending": _same("0.1-"),
    "blend_recompute_ratio": _ignored("LMCache v0's single share; use blend_recompute_ratios: "
                                      "[0.15]", "0.1-0.3.11"),
    "blend_recompute_ratios": _same("0.3.6-"),
    "blend_min_tokens": _same("0.1-"),
    "blend_special_str": _same("0.3.0-"),
    "blend_separator": _ignored("LMCache v0's separator; use blend_special_str",
                                "0.1-0.3.11"),
    "blend_add_special_in_precomp": _ignored(_BLEND, "0.1-0.3.11"),
    "blend_thresholds": _ignored(_BLEND, "0.3.6-"),
    "blend_check_layers": _same("0.3.6-"),
    # ---- peer-to-peer sharing
    "enable_p2p": _unsupported(_P2P, "0.2-"),
    "lookup_url": _unsupported(_P2P, "0.2-0.3.6"),
    "distributed_url": _unsupported(_P2P, "0.2-0.3.6"),
    "p2p_host": _unsupported(_P2P, "0.3.7-"),
    "p2p_init_ports": _unsupported(_P2P, "0.3.7-"),
    "p2p_lookup_ports": _unsupported(_P2P, "0.3.7-"),
    "peer_init_ports": _unsupported(_P2P, "docs 0.3.10-"),
    "peer_lookup_ports": _unsupported(_P2P, "docs 0.3.10-"),
    # ---- prefill-decode transfer (PD, NIXL)
    "enable_pd": _unsupported(_PD, "0.3.7-"),
    "enable_xpyd": _unsupported(_PD, "0.3.3-"),
    "enable_nixl": _unsupported(_PD, "0.2-0.3.6"),
    "transfer_channel": _unsupported(_PD, "0.3.7-"),
    "pd_role": _unsupported(_PD, "0.3.7-"),
    "pd_buffer_size": _unsupported(_PD, "0.3.7-"),
    "pd_buffer_device": _unsupported(_PD, "0.3.7-"),
    "pd_peer_host": _unsupported(_PD, "0.3.7-"),
    "pd_peer_init_port": _unsupported(_PD, "0.3.7-"),
    "pd_peer_alloc_port": _unsupported(_PD, "0.3.7-"),
    "pd_peer_query_port": _unsupported(_PD, "0.4.5-"),
    "pd_proxy_host": _unsupported(_PD, "0.3.7-"),
    "pd_proxy_port": _unsupported(_PD, "0.3.7-"),
    "pd_allocation_timeout_sec": _unsupported(_PD, "0.4.5-"),
    "pd_shutdown_timeout_sec": _unsupported(_PD, "0.4.5-"),
    "pd_condition_poll_interval_sec": _unsupported(_PD, "0.4.5-"),
    "pd_max_prefill_len": _unsupported(_PD, "0.4.5-"),
    "pd_backend_mode": _unsupported(_PD, "0.4.5-"),
    "pd_skip_proxy_notification": _unsupported(_PD, "0.4.4-"),
    "pd_bidirectional": _unsupported(_PD, "0.4.5-"),
    "nixl_role": _unsupported(_PD, "0.2-"),
    "nixl_peer_host": _unsupported(_PD, "0.2-"),
    "nixl_peer_port": _unsupported(_PD, "0.2-"),
    "nixl_peer_init_port": _unsupported(_PD, "0.3.3-"),
    "nixl_peer_alloc_port": _unsupported(_PD, "0.3.3-"),
    "nixl_proxy_host": _unsupported(_PD, "0.3.3-"),
    "nixl_proxy_port": _unsupported(_PD, "0.3.3-"),
    "nixl_receiver_host": _unsupported(_PD, "0.3.0-0.3.6"),
    "nixl_receiver_port": _unsupported(_PD, "0.3.0-0.3.6"),
    "nixl_buffer_size": _unsupported(_PD, "0.2-"),
    "nixl_buffer_device": _unsupported(_PD, "0.2-"),
    "nixl_enable_gc": _unsupported(_PD, "0.3.0-0.3.6"),
    "nixl_backends": _unsupported(_PD, "0.3.4-"),
    # ---- storage kvtier does not have
    "gds_path": _unsupported(_GDS, "0.3.1-"),
    "gds_path_sharding": _unsupported(_GDS, "0.4.3-"),
    "gds_buffer_size": _unsupported(_GDS, "0.4.4-"),
    "gds_backend": _unsupported(_GDS, "0.4.4-"),
    "use_gds": _unsupported(_GDS, "0.4.4-"),
    "cufile_buffer_size": _unsupported(_GDS, "0.3.1-0.4.3"),
    "weka_path": _unsupported("no Weka (GPU-direct) tier: use local_disk: file:///path/ on "
                              "the Weka mount", "0.3.1-0.3.11"),
    "maru_path": _unsupported(_MARU, "0.4.3-"),
    "maru_pool_size": _unsupported(_MARU, "0.4.3-"),
    "storage_plugins": _unsupported(_PLUGINS, "0.3.10.post1-"),
    "external_backends": _unsupported(_PLUGINS, "0.3.5-"),
    "remote_storage_plugins": _unsupported(_PLUGINS, "0.3.14-"),
    # ---- runtime plugins and scripts
    "plugin_locations": _ignored("no runtime plugins (scripts run beside the engine)",
                                 "0.3.4-"),
    "runtime_plugin_locations": _ignored("no runtime plugins (scripts run beside the engine)",
                                         "0.3.10.post1-"),
    "script_allowed_imports": _ignored(_API, "0.3.9.post1-"),
    "run_script_api_enabled": _ignored(_API, "0.5.6-"),
    # ---- controller, lookup and API servers
    "enable_controller": _ignored(_CONTROLLER, "0.3.0-"),
    "lmcache_instance_id": _ignored(_CONTROLLER, "0.3.0-"),
    "controller_url": _ignored(_CONTROLLER, "0.3.0-"),
    "controller_pull_url": _ignored(_CONTROLLER, "0.3.7-"),
    "controller_reply_url": _ignored(_CONTROLLER, "0.3.7-"),
    "lmcache_worker_port": _ignored(_CONTROLLER, "0.3.0-"),
    "lmcache_worker_ports": _ignored(_CONTROLLER, "0.3.7-"),
    "lmcache_worker_ids": _ignored(_CONTROLLER, "0.3.10-"),
    "lmcache_worker_heartbeat_delay_time": _ignored(_CONTROLLER, "0.3.5-"),
    "lmcache_worker_heartbeat_time": _ignored(_CONTROLLER, "0.3.5-"),
    "external_lookup_client": _ignored(_LOOKUP, "0.3.2-"),
    "lookup_timeout_ms": _ignored(_LOOKUP, "0.3.7-"),
    "lookup_server_worker_ids": _ignored(_LOOKUP, "0.3.9.post1-"),
    "mla_lookup_server_worker_id": _ignored(_LOOKUP, "0.3.9"),
    "hit_miss_ratio": _ignored(_LOOKUP, "0.3.7-"),
    "enable_scheduler_bypass_lookup": _ignored(_LOOKUP, "0.3.9.post1-"),
    "internal_api_server_enabled": _ignored(_API, "0.3.4-"),
    "internal_api_server_host": _ignored(_API, "0.3.4-"),
    "internal_api_server_port_start": _ignored(_API, "0.3.4-"),
    "internal_api_server_include_index_list": _ignored(_API, "0.3.4-"),
    "internal_api_server_socket_path_prefix": _ignored(_API, "0.3.4-"),
    "mp_host": _ignored(_MP, "0.4.6-"),
    "mp_port": _ignored(_MP, "0.4.6-"),
    "remote_config_url": _ignored(_REMOTE_CONFIG, "0.3.13-"),
    "app_id": _ignored(_REMOTE_CONFIG, "0.3.13-"),
    # ---- statistics, hidden states, encoder cache
    "enable_chunk_statistics": _ignored(_STATS, "0.3.10-"),
    "chunk_statistics_auto_start_statistics": _ignored(_STATS, "0.3.10-"),
    "chunk_statistics_auto_exit_timeout_hours": _ignored(_STATS, "0.3.10-"),
    "chunk_statistics_auto_exit_target_unique_chunks": _ignored(_STATS, "0.3.10-"),
    "chunk_statistics_strategy": _ignored(_STATS, "0.3.10-"),
    "enable_hidden_state_cache": _ignored(_HIDDEN, "0.5.1-"),
    "max_hidden_state_cpu_size": _ignored(_HIDDEN, "0.5.1-"),
    "hidden_state_layers": _ignored(_HIDDEN, "0.5.1-"),
    "hidden_states_retrieve_mode": _ignored(_HIDDEN, "0.5.1-"),
    "ec": _ignored(_EC, "0.4.5-"),
}

# Families of keys, by prefix: LMCache adds members between releases (`pd_*` grew five in
# 0.4.5), so a member this table does not list yet gets its family's status. `ec_<key>`
# (0.4.5-) is LMCache's encoder-cache copy of any key; `cost_aware_*` is on LMCache's main
# branch after 0.5.6.
PREFIXES: dict[str, LMCacheKey] = {
    "pd_": _unsupported(_PD, "0.3.7-"),
    "nixl_": _unsupported(_PD, "0.2-"),
    "p2p_": _unsupported(_P2P, "0.3.7-"),
    "gds_": _unsupported(_GDS, "0.3.1-"),
    "maru_": _unsupported(_MARU, "0.4.3-"),
    "blend_": _ignored("a CacheBlend option kvtier does not have; its blending keys are "
                       "enable_blending and blend_special_str, _recompute_ratios, "
                       "_check_layers, _min_tokens", "0.1-"),
    "controller_": _ignored(_CONTROLLER, "0.3.0-"),
    "lmcache_worker_": _ignored(_CONTROLLER, "0.3.0-"),
    "internal_api_server_": _ignored(_API, "0.3.4-"),
    "lookup_": _ignored(_LOOKUP, "0.3.7-"),
    "lazy_memory_": _ignored(_ARENA, "0.3.10-"),
    "chunk_statistics_": _ignored(_STATS, "0.3.10-"),
    "cost_aware_": _ignored("kvtier evicts LRU by chunk", "main after 0.5.6"),
    "hidden_state": _ignored(_HIDDEN, "0.5.1-"),
    "ec_": _ignored(_EC, "0.4.5-"),
}

# remote_url schemes LMCache serves and kvtier does not, with what to use instead. A remote
# tier there would silently vanish, so these are errors naming remote_url.
_SHARE = "share KV through a Redis server instead: remote_url: redis://host:6379"
UNSUPPORTED_SCHEMES: dict[str, str] = {
    "lm": "the LMCache server; " + _SHARE,
    "mooncakestore": "Mooncake Store; " + _SHARE,
    "s3": "S3; " + _SHARE + " (or local_disk: file:///path/ for a local copy)",
    "external": "an LMCache external connector; " + _SHARE,
    "infinistore": "InfiniStore; " + _SHARE,
    "valkey": "LMCache's Valkey connector; Valkey speaks RESP: remote_url: redis://host:6379",
    "blackhole": "LMCache's black-hole test connector; drop remote_url",
    "audit": "LMCache's audit connector; use remote_url: redis://host:6379 directly",
    "fs": "LMCache's file-system connector; use local_disk: file:///path/",
    "sagemaker-hyperpod": "SageMaker HyperPod; " + _SHARE,
    "mock": "LMCache's mock test connector; drop remote_url",
    "benchmark": "LMCache's simulated benchmark connector; drop remote_url (benchmarks/ "
                 "measures kvtier's own tiers)",
    "plugin": "an LMCache remote storage plugin; " + _SHARE,
    "eic": "Volcano Engine EIC; " + _SHARE,
    "azure": "Azure Blob storage; " + _SHARE,
    "bigtable": "Google Bigtable; " + _SHARE,
    "hf3fs": "3FS; " + _SHARE + " (or local_disk on a 3FS mount)",
}
