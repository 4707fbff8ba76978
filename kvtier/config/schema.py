"""The `Config` tree and the checks of its values (no host facts: see `kvtier.config.host`).

Every check raises `ConfigError` naming the key ("config: key: problem"; the loader replaces
"config" with the file or variable the value came from). Numbers must be finite and within
ceilings derived from what they do; `remote_url` is parsed in full here (by the parser its tier
registers in `kvtier.config.urls`), so a URL kvtier cannot serve fails at `check-config` time,
not when the tier is built.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvtier.config import tiers as tier_table
from kvtier.config.names import (
    ADAPTIVE,
    ADMISSION_POLICIES,
    EVICTION_POLICIES,
    LFUDA,
    NAMESPACE_PATTERN,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    WRITE_THROUGH,
)
from kvtier.config.paths import PATH_KEYS, check_local_disk, disk_path, resolved_paths
from kvtier.config.redaction import shown_value
from kvtier.config.remote_check import check_remote_url
from kvtier.config.sections import BlendSection, PrefetchSection, WriteSection
from kvtier.errors import ConfigError

__all__ = ["BlendSection", "Config", "PrefetchSection", "WriteSection", "validate", "REMOTE_SERDES",
           "TRANSFER_ARENA_GB", "PATH_KEYS"]

# The codecs of the lower tiers' records (kvtier.backends.codec.CODECS; docs/codecs.md).
REMOTE_SERDES = ("naive", "fp8", "int8")
VERIFY_SCOPES = ("full", "tail")
CHUNK_MULTIPLE = 16
MAX_CHUNK = 1 << 20  # tokens; a chunk is one arena object, and a prompt is far shorter
# The arena kvtier still needs to move chunks to and from disk/Redis when LMCache's
# `local_cpu: false` comes with `max_local_cpu_size: 0` (LMCache's "no CPU cache").
TRANSFER_ARENA_GB = 1.0
MAX_SESSION_PINNED_FRACTION = 0.8
MAX_SECONDS = 7 * 86400.0  # longer waits are mistakes (and overflow thread/socket timeouts)
# Ceilings derived from what each value does; above them a value is a typo or a unit mistake.
# Segments: below 64 KiB the per-command round trips dominate; Redis holds at most 512 MiB in
# one string (proto-max-bulk-len).
SEGMENT_MB_RANGE = (0.0625, 512.0)
# Each queued write holds an arena chunk until written; no arena holds more chunks than this.
MAX_WRITE_QUEUE_CHUNKS = 65536
# Upper bounds, by key: a request's wait for its load (recompute is faster than a minute's
# wait), the per-token budget (10 ms/token reaches 60 s at 6K tokens), `wait_complete`'s cap,
# the drain at close/flush, and one Redis socket operation.
MAX_BY_KEY = {"prefetch_timeout_base_ms": 60_000.0, "prefetch_timeout_per_token_ms": 10.0,
              "prefetch_wait_complete_max_ms": 600_000.0, "blocking_timeout_secs": 3600.0,
              "remote_timeout_secs": 600.0}


@dataclass(frozen=True)
class Config:
    """The effective configuration. Sizes are in GB (10**9 bytes), as in LMCache."""

    chunk_size: int = 256
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0
    local_disk: str | None = None
    max_local_disk_size: float = 0.0
    remote_url: str | None = None
    remote_serde: str = "naive"
    # Start with a remote_serde whose quality gate failed for the model (docs/codecs.md).
    remote_serde_override: bool = False
    save_unfull_chunk: bool = False
    blocking_timeout_secs: float = 10.0
    # kvtier's own keys
    hash_salt: str = ""
    # Also store each prefix's partial last chunk, in whole pages, where a longer prompt (the
    # conversation's next turn) finds it: hits reach to the page, not just to the chunk.
    save_tails: bool = True
    # Appears in every key string: tenants apart in Redis ACL patterns, `ls` and `purge`.
    key_namespace: str = "default"
    # A file holding secrets shared by the instances, one per line, the current first: records
    # on disk and in Redis are encrypted (AES-256-GCM) under the current one, and only records
    # encrypted under one of them are loaded (see docs/security.md).
    record_key_file: str | None = None
    write_policy: str = WRITE_THROUGH
    selective_write_threshold: int = 2
    # Which chunks a full CPU tier lets go of first, and which it declines to store at all
    # (kvtier.backends.cpu, kvtier.storage.admission; measured in docs/policies.md).
    eviction_policy: str = LFUDA
    # what it refuses still reaches disk and Redis (kvtier.engine.around)
    admission_policy: str = ADAPTIVE
    # The largest share of the CPU tier one tenant (a request's cache_salt) holds while
    # another holds chunks too: past it, its own chunks are evicted first (docs/policies.md).
    tenant_max_fraction: float = 0.5
    # A request waits for the part of its disk/Redis load that arrives sooner than it could
    # be recomputed (measured speeds; the running requests go on meanwhile).
    prefetch_policy: str = ADAPTIVE
    prefetch_timeout_base_ms: float = 200.0
    prefetch_timeout_per_token_ms: float = 0.02
    prefetch_wait_complete_max_ms: float = 30_000.0
    write_queue_chunks: int = 256
    remote_ttl_secs: int | None = None
    remote_timeout_secs: float = 2.0
    remote_segment_mb: float = 1.0  # measured: 1 MiB segments beat 4 MiB and unsegmented
    max_session_pinned_fraction: float = 0.5
    # Move a CPU KV pool onto transparent huge pages at launch (kvtier.connectors.hugepages).
    huge_pages: bool = True
    # On SGLang's CPU engine, an extend over a cached prefix computes the new tokens' attention
    # only (kvtier.integration.sglang.launch.cpu_attention): what makes a hit save time there.
    cpu_prefix_attention: bool = True
    # Share KV in disk/Redis for a model whose weights kvtier cannot read for a full digest
    # (a hub id not downloaded here): keyed by name and revision only.
    allow_unverified_weights: bool = False
    session_ttl_secs: float = 600.0
    # This share of the requests that would hit is computed as a miss instead, and the fresh
    # KV compared with what the tiers hold (kvtier.engine.verify); 0: off.
    verify_fraction: float = 0.0
    # What a verified request computes: "full" (its whole prompt, as a miss: every chunk is
    # compared) or "tail" (the prefix loads; the last full chunk of its hit is computed and
    # compared: one chunk's prefill, and a changed model or a bad prefix still shows there).
    verify_scope: str = "full"
    # Key the KV under this instead of the fingerprint of the model's weights and config: for
    # copies of one model whose files differ (another format of the same weights). A wrong
    # value shares KV between models that compute different KV: verify_fraction catches it.
    model_fingerprint: str | None = None
    # Reuse at any position (kvtier.blend; see docs/blending.md): a prompt's segments (each a
    # run of tokens ended by blend_special_str) load from the tiers wherever they stand, and
    # the blend_recompute_ratios share of their tokens is recomputed from blend_check_layers
    # on. LMCache's names and meanings.
    enable_blending: bool = False
    blend_special_str: str = " # # "
    blend_recompute_ratios: tuple[float, ...] = (0.15,)
    blend_check_layers: tuple[int, ...] = (1,)
    blend_min_tokens: int = 256  # a segment shorter than this is computed, never loaded
    # a blend runs only while measured to take at most this share of the full prefill's time
    blend_max_prefill_ratio: float = 1.0
    # SGLang's forward computes the recomputed tokens past the check layers (its CPU engine);
    # false: kvtier's forward computes every layer, off the scheduler thread
    blend_in_forward: bool = True
    log_level: str | None = None
    metrics_port: int | None = None  # serve Prometheus metrics on this port
    # With SGLang's --kv-events-config, kvtier's tiers publish what they gain and lose too.
    tier_events: bool = True

    def __post_init__(self) -> None:
        # "~/kv" must not make a directory "~"; "kv/" is where the server starts, now
        for key, path in resolved_paths(self).items():
            object.__setattr__(self, key, path)
        validate(self)

    @property
    def tiers(self) -> tuple[str, ...]:
        """Tier names from fastest to slowest; the order puts and gets walk."""
        return tuple(spec.name for spec in tier_table.TABLE if spec.enabled(self))

    @property
    def prefetch(self) -> PrefetchSection:
        return PrefetchSection(self.prefetch_policy, self.prefetch_timeout_base_ms,
                               self.prefetch_timeout_per_token_ms,
                               self.prefetch_wait_complete_max_ms)

    @property
    def blend(self) -> BlendSection:
        return BlendSection(self.enable_blending, self.blend_special_str,
                            self.blend_check_layers, self.blend_recompute_ratios,
                            self.blend_min_tokens, self.blend_max_prefill_ratio,
                            self.blend_in_forward)

    @property
    def writes(self) -> WriteSection:
        return WriteSection(self.write_policy, self.selective_write_threshold)

    @property
    def local_disk_path(self) -> Path | None:
        if self.local_disk is None:
            return None
        return Path(disk_path(self.local_disk))

    def __repr__(self) -> str:  # credentials never reach a log line or a traceback
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self.redacted().items()) + ")"

    def redacted(self) -> dict[str, Any]:
        """The config as a plain dict as it may be shown (logs, `check-config`,
        `migrate-config`, `repr`): every value through `shown_value`, so URL passwords and
        secret keys (`hash_salt`, names holding auth/cred/key/pass/secret/token) are `***`."""
        return {k: shown_value(k, v) for k, v in dataclasses.asdict(self).items()}


def _fail(source: str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {msg}")


def validate(cfg: Config) -> None:
    """`ConfigError` naming the first bad key of `cfg`."""
    _validate_numbers(cfg)
    _validate_memory(cfg)
    _validate_choices(cfg)
    _validate_tiers(cfg)
    _validate_blend(cfg)


# Deeper check layers than any model has are refused when the model is known (at launch).
MAX_BLEND_MIN_TOKENS = 1 << 20


def _validate_blend(cfg: Config) -> None:
    src = "config"
    layers, ratios = cfg.blend_check_layers, cfg.blend_recompute_ratios
    if not layers or len(layers) != len(ratios):
        raise _fail(src, "blend_check_layers", f"must be a non-empty list as long as "
                    f"blend_recompute_ratios (one share per check layer), got {list(layers)} "
                    f"and {list(ratios)}")
    if any(x < 0 for x in layers) or list(layers) != sorted(set(layers)):
        raise _fail(src, "blend_check_layers", f"must be layer numbers (>= 0) in increasing "
                    f"order, got {list(layers)}")
    if any(not 0.0 <= r <= 1.0 for r in ratios) or list(ratios) != sorted(ratios, reverse=True):
        raise _fail(src, "blend_recompute_ratios", f"must be shares in [0, 1] that do not "
                    f"increase (each check layer narrows the last), got {list(ratios)}")
    if not 1 <= cfg.blend_min_tokens <= MAX_BLEND_MIN_TOKENS:
        raise _fail(src, "blend_min_tokens", f"must be in 1..{MAX_BLEND_MIN_TOKENS}, got "
                    f"{cfg.blend_min_tokens}")
    if not cfg.blend_special_str:
        raise _fail(src, "blend_special_str", "must not be empty (it marks where segments end)")
    if not 0.0 < cfg.blend_max_prefill_ratio < math.inf:
        raise _fail(src, "blend_max_prefill_ratio", f"must be a positive number, got "
                    f"{cfg.blend_max_prefill_ratio}")


def _validate_numbers(cfg: Config) -> None:
    src = "config"
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise _fail(src, f.name, f"must be a finite number, got {value}")
    if not 0 < cfg.chunk_size <= MAX_CHUNK or cfg.chunk_size % CHUNK_MULTIPLE:
        raise _fail(src, "chunk_size", f"must be a positive multiple of {CHUNK_MULTIPLE} "
                    f"up to {MAX_CHUNK}, got {cfg.chunk_size}")
    for key in ("max_local_cpu_size", "max_local_disk_size", "blocking_timeout_secs",
                "prefetch_timeout_base_ms", "prefetch_timeout_per_token_ms",
                "prefetch_wait_complete_max_ms"):
        if getattr(cfg, key) < 0:
            raise _fail(src, key, f"must not be negative, got {getattr(cfg, key)}")
    for key, limit in MAX_BY_KEY.items():
        if getattr(cfg, key) > limit:
            raise _fail(src, key, f"must be at most {limit:g}, got {getattr(cfg, key):g}")
    if cfg.selective_write_threshold < 1:
        raise _fail(src, "selective_write_threshold",
                    f"must be >= 1, got {cfg.selective_write_threshold}")
    if not 1 <= cfg.write_queue_chunks <= MAX_WRITE_QUEUE_CHUNKS:
        raise _fail(src, "write_queue_chunks", f"must be in 1..{MAX_WRITE_QUEUE_CHUNKS}, got "
                    f"{cfg.write_queue_chunks}")
    if cfg.remote_ttl_secs is not None and not 0 < cfg.remote_ttl_secs <= 2**31:
        raise _fail(src, "remote_ttl_secs", f"must be in 1..2**31, got {cfg.remote_ttl_secs}")
    if cfg.remote_timeout_secs <= 0:
        raise _fail(src, "remote_timeout_secs", f"must be > 0, got {cfg.remote_timeout_secs}")
    low, high = SEGMENT_MB_RANGE
    if not low <= cfg.remote_segment_mb <= high:
        raise _fail(src, "remote_segment_mb", f"must be in [{low:g}, {high:g}] (MiB: 64 KiB to "
                    f"Redis's 512 MiB string limit), got {cfg.remote_segment_mb:g}")
    if cfg.metrics_port is not None and not 1 <= cfg.metrics_port <= 65535:
        raise _fail(src, "metrics_port", f"must be in 1..65535 or null, got {cfg.metrics_port}")
    if not 0.0 <= cfg.max_session_pinned_fraction <= MAX_SESSION_PINNED_FRACTION:
        raise _fail(src, "max_session_pinned_fraction",
                    f"must lie in [0, {MAX_SESSION_PINNED_FRACTION}] (the rest of the CPU tier "
                    f"stays evictable for stores and prefetches), got "
                    f"{cfg.max_session_pinned_fraction}")
    if not 0.0 < cfg.tenant_max_fraction <= 1.0:
        raise _fail(src, "tenant_max_fraction",
                    f"must lie in (0, 1] (a share of the tier; 1: no share), got "
                    f"{cfg.tenant_max_fraction}")
    if not 0.0 <= cfg.verify_fraction <= 1.0:
        raise _fail(src, "verify_fraction",
                    f"must lie in [0, 1] (a share of the requests), got {cfg.verify_fraction}")
    if cfg.verify_scope not in VERIFY_SCOPES:
        raise _fail(src, "verify_scope",
                    f"must be one of {', '.join(VERIFY_SCOPES)}, got {cfg.verify_scope!r}")
    if not 0 < cfg.session_ttl_secs <= MAX_SECONDS:
        raise _fail(src, "session_ttl_secs",
                    f"must be in (0, {MAX_SECONDS:g}], got {cfg.session_ttl_secs}")


def _validate_memory(cfg: Config) -> None:
    # Whether the arena fits this machine is a host check (`memory_problem`), not a property of
    # the file: a file sized for a bigger host must pass `check-config` with a warning.
    if cfg.max_local_cpu_size * 1e9 < 4096:
        raise _fail("config", "max_local_cpu_size",
                    f"must be > 0 (it sizes the staging arena), got {cfg.max_local_cpu_size}")


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _validate_choices(cfg: Config) -> None:
    if cfg.log_level is not None and cfg.log_level.lower() not in LOG_LEVELS:
        raise _fail("config", "log_level",
                    f"must be one of {list(LOG_LEVELS)} or null, got {cfg.log_level!r}")
    choices = (("write_policy", WRITE_POLICIES), ("prefetch_policy", PREFETCH_POLICIES),
               ("remote_serde", REMOTE_SERDES), ("eviction_policy", EVICTION_POLICIES),
               ("admission_policy", ADMISSION_POLICIES))
    for key, allowed in choices:
        if getattr(cfg, key) not in allowed:
            raise _fail("config", key, f"must be one of {list(allowed)}, got {getattr(cfg, key)!r}")
    if cfg.model_fingerprint is not None and \
            not NAMESPACE_PATTERN.fullmatch(str(cfg.model_fingerprint)):
        raise _fail("config", "model_fingerprint", f"must be 1-64 of A-Z a-z 0-9 . _ - (it is "
                    f"part of every key), got {cfg.model_fingerprint!r}")
    if not NAMESPACE_PATTERN.fullmatch(str(cfg.key_namespace)):
        raise _fail("config", "key_namespace", f"must be 1-64 of A-Z a-z 0-9 . _ - (it is part "
                    f"of every key), got {cfg.key_namespace!r}")


def _validate_tiers(cfg: Config) -> None:
    src = "config"
    if cfg.local_disk is not None:
        check_local_disk(cfg.local_disk)
        if cfg.max_local_disk_size <= 0:
            raise _fail(src, "max_local_disk_size",
                        f"must be > 0 when local_disk is set, got {cfg.max_local_disk_size}")
    if cfg.remote_url is not None:
        check_remote_url(cfg.remote_url)
    if not cfg.local_cpu and not cfg.local_disk and not cfg.remote_url:
        raise _fail(src, "local_cpu", "no tier enabled: local_cpu is false and neither "
                    "local_disk nor remote_url is set, so kvtier would store nothing. Storage "
                    "only LMCache has is not supported: kvtier does not do PD transfer (drop "
                    "enable_pd/nixl_* and keep local_cpu), GPU-direct or Weka storage "
                    "(gds_path, weka_path: use local_disk: file:///path/) or storage plugins; "
                    "keep local_cpu: true, or set local_disk or a shared remote_url: "
                    "redis://host:6379 (`kvtier migrate-config FILE` names the key)")
