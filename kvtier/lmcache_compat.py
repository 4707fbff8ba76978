"""LMCache config files in kvtier: which LMCache keys kvtier ignores and what it does instead,
and the LMCache value forms it translates.

An LMCache engine config (LMCache 0.5.x `lmcache/v1/config.py`, plus the v0 keys still found in
old files) has three kinds of keys as far as kvtier is concerned:

1. keys kvtier implements with the same meaning (fields of `kvtier.config.Config`);
2. keys kvtier does not implement (`UNIMPLEMENTED`, `UNIMPLEMENTED_PREFIXES`): accepted, listed
   in one warning together with what kvtier does instead;
3. anything else: an unknown key, a `ConfigError` with the nearest valid key.

Ignoring a key is an error only where it would silently change what the user gets; the cases
are handled where the value is checked (a `remote_url` kvtier cannot serve, `local_disk` naming
several disks, a config with no tier left).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kvtier.errors import ConfigError

__all__ = ["UNIMPLEMENTED", "UNIMPLEMENTED_PREFIXES", "UNSUPPORTED_SCHEMES", "instead_of",
           "Translated", "translate_values", "extra_config_ignored", "secret_key"]

_NO_PD = ("not implemented: kvtier does not send KV between prefill and decode instances; give "
          "them one shared remote_url to reuse KV across instances")
_NO_P2P = "not implemented: no peer-to-peer transfer; share KV through a Redis remote_url"
_NO_CONTROLLER = ("not implemented: no cache controller; `kvtier stats|ls|purge` inspect the "
                  "tiers")
_NO_GDS = ("not implemented: no GPU-direct storage tier; use local_disk for a file-backed "
           "tier")
_NO_PLUGINS = "not implemented: no storage plugins; the tiers are cpu, disk and redis"
_NO_BLEND = "not implemented: prefix reuse only (no CacheBlend of non-prefix chunks)"
_NO_LOOKUP = ("not implemented: each engine looks up its own tiers; lookup() answers from "
              "them directly")
_NO_API = ("not implemented: no internal API server; metrics_port serves Prometheus "
           "metrics")
_ARENA = "not implemented: one arena of max_local_cpu_size GB, allocated once at start-up"
_HIDDEN = "not implemented: kvtier stores KV only (no hidden-state cache)"

# LMCache key -> what kvtier does instead. Everything here is accepted and ignored, with one
# warning per load listing the keys found.
UNIMPLEMENTED: dict[str, str] = {
    "use_layerwise": ("not implemented: kvtier moves whole chunks, every layer in one copy "
                      "(no layer-by-layer pipelining)"),
    "enable_async_loading": ("not implemented: retrieve() loads synchronously; "
                             "prefetch_policy loads lower tiers ahead"),
    "save_decode_cache": ("not implemented: kvtier stores the tokens the serving engine passes "
                          "to store() (the SGLang integration: each finished request)"),
    "extra_config": ("only username/password are used (credentials for remote_url); other "
                     "entries are ignored"),
    "local_device": ("old LMCache v0 key, not implemented: CPU memory is local_cpu/"
                     "max_local_cpu_size, disk is local_disk"),
    "pipelined_backend": ("old LMCache v0 key, not implemented: lower-tier writes always run "
                          "in the background"),
    "local_cpu_use_hugepages": _ARENA + " (regular pages, faulted in at start-up)",
    "reserve_local_cpu_size": _ARENA,
    "local_disk_path_sharding": ("not implemented: one directory; TP ranks are keyed apart "
                                 "inside it"),
    "pre_caching_hash_algorithm": "not implemented: chunk keys are always chained SHA-256",
    "enable_blending": _NO_BLEND,
    "retrieve_locations": "not implemented: tiers are read in order cpu -> disk -> redis",
    "store_location": "not implemented: every tier is written, per write_policy",
    "enable_p2p": _NO_P2P,
    "transfer_channel": _NO_PD,
    "mp_host": "not implemented: kvtier runs inside the serving process (no MP server)",
    "mp_port": "not implemented: kvtier runs inside the serving process (no MP server)",
    "enable_controller": _NO_CONTROLLER,
    "lmcache_instance_id": _NO_CONTROLLER,
    "enable_pd": _NO_PD,
    "enable_xpyd": _NO_PD,
    "enable_nixl": _NO_PD,
    "use_gds": _NO_GDS,
    "weka_path": _NO_GDS,
    "cufile_buffer_size": _NO_GDS,
    "audit_actual_remote_url": "not implemented: no audit connector",
    "external_lookup_client": _NO_LOOKUP,
    "lookup_url": _NO_LOOKUP,
    "distributed_url": _NO_LOOKUP,
    "hit_miss_ratio": _NO_LOOKUP,
    "enable_scheduler_bypass_lookup": _NO_LOOKUP,
    "min_retrieve_tokens": "not implemented: any hit of one chunk or more is loaded",
    "py_enable_gc": "not implemented: kvtier leaves Python's garbage collector alone",
    "cache_policy": ("not implemented: LRU by chunk, deeper chunks of a prefix evicted "
                     "first"),
    "numa_mode": "not implemented: the arena is not bound to a NUMA node",
    "priority_limit": "not implemented: every request may store",
    "plugin_locations": _NO_PLUGINS,
    "runtime_plugin_locations": _NO_PLUGINS,
    "storage_plugins": _NO_PLUGINS,
    "remote_storage_plugins": _NO_PLUGINS,
    "external_backends": _NO_PLUGINS,
    "script_allowed_imports": _NO_PLUGINS,
    "error_handling": ("not implemented: a tier failure is always a counted miss; serving "
                       "goes on"),
    "cache_engine_args": "not implemented: the engine is configured by this file only",
    "remote_config_url": ("not implemented: config comes from this file and the environment "
                          "only"),
    "app_id": "not implemented: config comes from this file and the environment only",
    "enable_lazy_memory_allocator": _ARENA,
    "enable_chunk_statistics": "not implemented: counters are in stats() and the metrics",
    "enable_kv_events": "not implemented: no KV event stream",
    "use_gpu_connector_v3": "not implemented: kvtier's connectors read SGLang's pools",
    "pin_timeout_sec": ("not implemented: leases end with each copy; nothing stays pinned "
                        "between calls"),
    "pin_check_interval_sec": ("not implemented: leases end with each copy; nothing stays "
                               "pinned between calls"),
    "enable_hidden_state_cache": _HIDDEN,
    "max_hidden_state_cpu_size": _HIDDEN,
    "hidden_state_layers": _HIDDEN,
    "hidden_states_retrieve_mode": _HIDDEN,
    "use_experimental": ("LMCache's v0/v1 switch: kvtier has one implementation (the "
                         "LMCACHE_USE_EXPERIMENTAL variable is ignored too)"),
    "maru_path": "not implemented: no CXL shared-memory tier",
    "maru_pool_size": "not implemented: no CXL shared-memory tier",
}

# Families of LMCache keys, by prefix (their members change between LMCache releases).
UNIMPLEMENTED_PREFIXES: dict[str, str] = {
    "pd_": _NO_PD,
    "nixl_": _NO_PD,
    "p2p_": _NO_P2P,
    "blend_": _NO_BLEND,
    "controller_": _NO_CONTROLLER,
    "lmcache_worker_": _NO_CONTROLLER,
    "internal_api_server_": _NO_API,
    "gds_": _NO_GDS,
    "lazy_memory_": _ARENA,
    "chunk_statistics_": "not implemented: counters are in stats() and the metrics",
    "cost_aware_": "not implemented: LRU by chunk",
    "lookup_": _NO_LOOKUP,
}

# remote_url schemes LMCache serves and kvtier does not: a remote tier there would silently
# vanish, so these are errors (kvtier.config names the supported schemes).
UNSUPPORTED_SCHEMES: dict[str, str] = {
    "lm": "the LMCache server",
    "mooncakestore": "Mooncake Store",
    "s3": "S3",
    "external": "an LMCache external connector",
    "infinistore": "InfiniStore",
    "valkey": "LMCache's Valkey connector",
    "blackhole": "LMCache's black-hole connector",
    "audit": "LMCache's audit connector",
    "fs": "LMCache's file-system connector (use local_disk)",
    "sagemaker-hyperpod": "SageMaker HyperPod",
}

# What LMCache's remote_serde values become: kvtier stores records uncompressed.
_SERDE_AS_RAW = {None: "null", "cachegen": "cachegen", "torch": "torch", "safetensor":
                 "safetensor", "kivi": "kivi"}
_CREDENTIAL_KEYS = ("username", "password")
# A key whose name holds one of these words (any case) is taken for a secret: when in doubt a
# value is hidden, never shown. LMCache has no such top-level key today, but extra_config
# entries (`aws_secret_access_key`, `*_auth`, `*credential*`) and unknown keys may carry them.
_SECRET_WORDS = ("auth", "cred", "key", "pass", "secret", "token")
# Secrets whose names hold none of the words: `hash_salt` keys the chunk digests; whoever knows
# it can compute the keys of a guessed prompt and probe a shared tier for it.
_SECRET_NAMES = frozenset({"hash_salt"})
# Known keys that hold a secret word and no secret (token counts, the path of a TLS key file in
# a Redis URL's query); everything else that matches stays hidden.
_NOT_SECRET = frozenset({"prefetch_timeout_per_token_ms", "min_retrieve_tokens",
                         "blend_min_tokens", "ssl_keyfile", "key_namespace",
                         "record_key_file"})


def instead_of(key: str) -> str | None:
    """What kvtier does instead of LMCache key `key`, or None if `key` is not an LMCache key
    kvtier ignores."""
    if key in UNIMPLEMENTED:
        return UNIMPLEMENTED[key]
    for prefix, instead in UNIMPLEMENTED_PREFIXES.items():
        if key.startswith(prefix):
            return instead
    return None


def secret_key(key: str) -> bool:
    """True if a value under `key` must never be shown (logs, CLI output, error messages).

    Matches names holding auth/cred/key/pass/secret/token in any case, and `hash_salt` (also
    as the last part of a dotted name: `extra_config.hash_salt`), except a few known token
    counts (`prefetch_timeout_per_token_ms`). Display only: a secret key loads and is used like
    any other.
    """
    name = key.lower()
    if name in _NOT_SECRET:
        return False
    return (name.rpartition(".")[2] in _SECRET_NAMES
            or any(word in name for word in _SECRET_WORDS))


def extra_config_ignored(extra: Mapping[str, Any]) -> list[str]:
    """The entries of `extra_config` kvtier ignores, as `extra_config.<name>`."""
    return [f"extra_config.{k}" for k in extra if k not in _CREDENTIAL_KEYS]


@dataclass(frozen=True)
class Translated:
    """LMCache values rewritten into kvtier's forms, and one (key, note) per rewrite."""

    values: dict[str, Any]
    notes: tuple[tuple[str, str], ...]


def translate_values(values: Mapping[str, Any], extra: Mapping[str, Any] | None,
                     source: str) -> Translated:
    """Rewrite LMCache value forms in the raw (not yet type-checked) `values`.

    - `remote_serde` null / cachegen / torch -> "naive" (kvtier stores raw records);
    - `remote_url` resp:// -> redis:// (LMCache's RESP client speaks to a Redis server);
    - `extra_config` username/password -> the credentials of `remote_url`.

    Raises:
        ConfigError: credentials both in `remote_url` and in `extra_config`, or not strings.
    """
    out = dict(values)
    notes: list[tuple[str, str]] = []
    if "remote_serde" in out and _serde_key(out["remote_serde"]) in _SERDE_AS_RAW:
        given = _SERDE_AS_RAW[_serde_key(out["remote_serde"])]
        out["remote_serde"] = "naive"
        notes.append(("remote_serde", f"{given}: kvtier stores records uncompressed ('naive')"))
    url = out.get("remote_url")
    if isinstance(url, str) and url.startswith("resp://"):
        out["remote_url"] = "redis://" + url[len("resp://"):]
        notes.append(("remote_url", "resp:// is read as redis:// (the same RESP protocol)"))
    if extra:
        creds = {k: extra[k] for k in _CREDENTIAL_KEYS if extra.get(k) is not None}
        if creds:
            out["remote_url"], note = _with_credentials(out.get("remote_url"), creds, source)
            notes.append(("extra_config", note))
    return Translated(out, tuple(notes))


def _serde_key(value: Any) -> str | None:
    if value is None:
        return None
    return value.strip().lower() if isinstance(value, str) else "?"


def _with_credentials(url: Any, creds: Mapping[str, Any], source: str) -> tuple[Any, str]:
    for name, value in creds.items():
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ConfigError(f"{source}: extra_config.{name}: must be a string, got "
                              f"{type(value).__name__}")
    if not isinstance(url, str):
        return url, "username/password: unused (no remote_url)"
    scheme, sep, rest = url.partition("://")
    if not sep or "@" in rest.partition("?")[0].partition("/")[0] or (
            scheme == "unix" and "@" in rest):
        raise ConfigError(f"{source}: extra_config.{next(iter(creds))}: remote_url already "
                          "carries credentials; keep them in one place")
    user = quote(str(creds.get("username", "")), safe="")
    password = creds.get("password")
    userinfo = user + (":" + quote(str(password), safe="") if password is not None else "")
    return (f"{scheme}://{userinfo}@{rest}",
            "username/password: used as the credentials of remote_url")
