"""Checks of a `Config`'s values, and how values may be shown in messages (URLs redacted,
secrets masked).

Every check raises `ConfigError` naming the key ("config: key: problem"; the loader replaces
"config" with the file or variable the value came from). Numbers must be finite and within
ceilings derived from what they do; `remote_url` is parsed in full here, so a URL kvtier cannot
serve fails at `check-config` time, not when the tier is built. What depends on the host (the
arenas of every TP rank against physical memory and the cgroup limit, even a single one; disk
space) is checked apart (`host_problems`): a file may be sized for a bigger host, so
`check-config` warns and the launch refuses (`check_host`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier import lmcache_compat as compat
from kvtier.errors import ConfigError
from kvtier.names import PREFETCH_POLICIES, WRITE_POLICIES
from kvtier.urls import REMOTE_SCHEMES, redact_url

if TYPE_CHECKING:
    from kvtier.config import Config

__all__ = ["validate", "physical_memory_bytes", "available_memory_bytes", "arena_now_problem",
           "cgroup_memory_limit", "host_problems", "check_host", "REMOTE_SERDES",
           "TRANSFER_ARENA_GB"]

REMOTE_SERDES = ("naive",)
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


def physical_memory_bytes() -> int:
    """The machine's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def shown_value(key: str, value: Any) -> Any:
    """`value` of `key` as it may be shown to users (logs, CLI output).

    A secret key (`lmcache_compat.secret_key`: `hash_salt`, names holding
    auth/cred/key/pass/secret/token) shows `***` unless unset (None or ""); a mapping shows
    `{...}` (its entries may be secrets under innocent-looking keys); a URL shows through
    `redact_url`; anything else as it is.
    """
    if compat.secret_key(key) and value not in (None, ""):
        return "***"
    if isinstance(value, Mapping):
        return "{...}"
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value


def shown_in_error(key: str, value: Any) -> str:
    """`value` of `key` as an error message may echo it: `***` for a secret key, and for
    `remote_url` whatever its type (a URL in a list is not redacted by `redact_url`)."""
    if key == "remote_url" or compat.secret_key(key):
        return "***"
    return repr(value)


def _fail(source: str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {msg}")


def validate(cfg: Config) -> None:
    """`ConfigError` naming the first bad key of `cfg`."""
    _validate_numbers(cfg)
    _validate_memory(cfg)
    _validate_choices(cfg)
    _validate_tiers(cfg)


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
               ("remote_serde", REMOTE_SERDES))
    for key, allowed in choices:
        if getattr(cfg, key) not in allowed:
            raise _fail("config", key, f"must be one of {list(allowed)}, got {getattr(cfg, key)!r}")
    from kvtier.keys import NAMESPACE_PATTERN

    if not NAMESPACE_PATTERN.fullmatch(str(cfg.key_namespace)):
        raise _fail("config", "key_namespace", f"must be 1-64 of A-Z a-z 0-9 . _ - (it is part "
                    f"of every key), got {cfg.key_namespace!r}")


def _validate_tiers(cfg: Config) -> None:
    src = "config"
    if cfg.local_disk is not None:
        _check_local_disk(cfg.local_disk)
        if cfg.max_local_disk_size <= 0:
            raise _fail(src, "max_local_disk_size",
                        f"must be > 0 when local_disk is set, got {cfg.max_local_disk_size}")
    if cfg.remote_url is not None:
        _check_remote_url(cfg.remote_url)
    if not cfg.local_cpu and not cfg.local_disk and not cfg.remote_url:
        raise _fail(src, "local_cpu", "no tier enabled: local_cpu is false and neither "
                    "local_disk nor remote_url is set, so kvtier would store nothing. Storage "
                    "only LMCache has is not supported: kvtier does not do PD transfer (drop "
                    "enable_pd/nixl_* and keep local_cpu), GPU-direct or Weka storage "
                    "(gds_path, weka_path: use local_disk: file:///path/) or storage plugins; "
                    "keep local_cpu: true, or set local_disk or a shared remote_url: "
                    "redis://host:6379 (`kvtier migrate-config FILE` names the key)")


def _check_local_disk(value: str) -> None:
    parts = [p.strip() for p in value.split(",")]
    if len(parts) > 1 and all(p.startswith(("file://", "/", "~")) for p in parts[1:]):
        raise _fail("config", "local_disk",
                    f"several disks ({value!r}) are not supported: kvtier keeps one directory "
                    "(pick one, or put the disks behind one mount)")
    path = value.strip().removeprefix("file://").strip()
    if not path or value.startswith(("redis", "http")) or "://" in path:
        raise _fail("config", "local_disk",
                    f"must be a directory path or file:///path URL, got {value!r}")


def _check_remote_url(url: str) -> None:
    """Scheme first (no imports), then the full parse of the Redis tier, at config time."""
    scheme, sep, _ = url.partition("://")
    shown = redact_url(url)
    supported = ", ".join(s + "://" for s in REMOTE_SCHEMES) + " (resp:// = redis://)"
    if scheme in compat.UNSUPPORTED_SCHEMES:
        raise _fail("config", "remote_url",
                    f"{shown!r}: kvtier cannot serve {scheme}:// "
                    f"({compat.UNSUPPORTED_SCHEMES[scheme]}); supported schemes: {supported}")
    if not sep or scheme not in (*REMOTE_SCHEMES, "resp"):
        raise _fail("config", "remote_url", f"{shown!r}: scheme must be one of {supported}")
    try:
        from kvtier.backends.redis.url import parse_remote_url
    except ImportError as exc:
        raise _fail("config", "remote_url", f"the Redis tier needs the 'redis' package "
                    f"(redis-py), which cannot be imported ({exc}): "
                    "pip install 'kvtier[redis]'") from None
    try:
        parse_remote_url(url)
    except ConfigError as exc:
        raise ConfigError(f"config: {exc}") from None


# ---- host checks: the machine this runs on ------------------------------------------------
# These depend on the host, and a file may be written for another one: `kvtier check-config`
# prints them as warnings, the launch (`check_host`) refuses.

CGROUP_ROOT = "/sys/fs/cgroup"
# Disk headroom kept free for everything else on the filesystem: 5% of it, at most 1 GB (ext4
# already holds back 5% for root, outside the free space counted here).
DISK_RESERVE_FRACTION = 0.05
DISK_RESERVE_BYTES = 10**9
# Memory left free beside a new arena, for the process itself (its threads, allocator slack).
MEMORY_HEADROOM_BYTES = 10**9
MAX_DISK_WALK = 200_000  # entries; a larger directory is not summed (and the check skipped)


def cgroup_memory_limit(path: str | os.PathLike[str] | None = None) -> int | None:
    """The cgroup v2 memory limit in bytes, or None for none.

    `path`: the `memory.max` file to read. Default: this process's cgroup (from
    /proc/self/cgroup) and each ancestor up to /sys/fs/cgroup; the smallest limit wins. "max",
    a missing or an unreadable file mean no limit."""
    files = [Path(path)] if path is not None else _own_memory_max_files()
    limits = []
    for file in files:
        try:
            text = file.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits, default=None)


def _own_memory_max_files() -> list[Path]:
    root = Path(CGROUP_ROOT)
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    own = root / next((line[3:] for line in lines if line.startswith("0::")), "/").lstrip("/")
    return [d / "memory.max" for d in (own, *own.parents) if d.is_relative_to(root)]


def memory_problem(cfg: Config, *, local_ranks: int = 1,
                   cgroup_path: str | os.PathLike[str] | None = None) -> str | None:
    """Why `local_ranks` arenas of `max_local_cpu_size` (each TP rank on this host allocates
    its own) do not fit this host's memory, the smaller of physical memory and the cgroup v2
    limit (`cgroup_memory_limit(cgroup_path)`); None when they fit. No headroom beyond that.
    One rank is checked too: a single arena larger than the host is refused here, at launch
    (`check_host`), and only warned about by `check-config`."""
    if local_ranks < 1:
        raise ValueError(f"local_ranks must be >= 1, got {local_ranks}")
    limit, what = physical_memory_bytes(), "physical memory"
    cgroup = cgroup_memory_limit(cgroup_path)
    if cgroup is not None and cgroup < limit:
        limit, what = cgroup, "cgroup memory limit (memory.max)"
    need = cfg.max_local_cpu_size * 1e9 * local_ranks
    if need <= limit:
        return None
    return (f"max_local_cpu_size: {cfg.max_local_cpu_size:g} GB x {local_ranks} local rank(s) "
            f"= {need / 1e9:.2f} GB of arenas (each TP rank allocates its own) is more than "
            f"this host's {what} of {limit / 1e9:.2f} GB: at most "
            f"{limit / local_ranks / 1e9:.2f} GB per rank")


def available_memory_bytes(meminfo: str | os.PathLike[str] = "/proc/meminfo") -> int | None:
    """What can be allocated now without swapping: `MemAvailable`, and under each cgroup v2
    limit of this process, that limit less the cgroup's `memory.current`; the smallest. None
    when none of them can be read."""
    found = []
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file in _own_memory_max_files():
        try:
            limit = limit_file.read_text().strip()
            current = (limit_file.parent / "memory.current").read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and current.isdigit():
            found.append(max(0, int(limit) - int(current)))
    return min(found, default=None)


def arena_now_problem(cfg: Config, *, available: int | None = None) -> str | None:
    """Why an arena of `max_local_cpu_size` does not fit the memory available now
    (`available`, default `available_memory_bytes()`) with `MEMORY_HEADROOM_BYTES` left over;
    None when it fits or availability cannot be read. Checked where the arena is allocated:
    in a server that is after the engine's own allocations (on a CPU server, SGLang's KV pool
    and weights), which a check at launch cannot know."""
    avail = available_memory_bytes() if available is None else available
    need = cfg.max_local_cpu_size * 1e9
    if avail is None or need + MEMORY_HEADROOM_BYTES <= avail:
        return None
    room = max(0, avail - MEMORY_HEADROOM_BYTES)
    return (f"max_local_cpu_size: {cfg.max_local_cpu_size:g} GB does not fit the memory "
            f"available now: {avail / 1e9:.2f} GB available (after what the serving engine "
            f"has allocated: on a CPU server its KV pool and weights) - "
            f"{MEMORY_HEADROOM_BYTES / 1e9:.2f} GB kept free = at most {room / 1e9:.2f} GB; "
            f"lower max_local_cpu_size, or the engine's own pool (SGLang: --max-total-tokens, "
            f"--mem-fraction-static)")


def _bytes_under(root: Path) -> int | None:
    """Total size of the regular files under `root` (0 if it does not exist), or None past
    `MAX_DISK_WALK` entries. Symlinks are neither followed nor counted."""
    total, seen, stack = 0, 0, [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    seen += 1
                    if seen > MAX_DISK_WALK:
                        return None
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue  # missing or unreadable: nothing of ours to count there
    return total


def disk_problem(cfg: Config) -> str | None:
    """Why `max_local_disk_size` does not fit the filesystem of `local_disk` (of its nearest
    existing parent when it does not exist yet): it may use the free space plus what is
    already stored under it, less a reserve (`DISK_RESERVE_*`). None when it fits, when there
    is no disk tier, or when this cannot be judged cheaply (statvfs fails, huge directory)."""
    if cfg.local_disk_path is None:
        return None
    root = Path(os.path.abspath(cfg.local_disk_path))
    existing = root
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        st = os.statvfs(existing)
    except OSError:
        return None
    held = _bytes_under(root)
    if held is None:
        return None
    free, reserve = st.f_bavail * st.f_frsize, min(DISK_RESERVE_FRACTION * st.f_blocks
                                                    * st.f_frsize, DISK_RESERVE_BYTES)
    room = free + held - reserve
    if cfg.max_local_disk_size * 1e9 <= room:
        return None
    return (f"max_local_disk_size: {cfg.max_local_disk_size:g} GB is more than the filesystem "
            f"of {existing} can give the disk tier: {free / 1e9:.2f} GB free + "
            f"{held / 1e9:.2f} GB already under {root} - {reserve / 1e9:.2f} GB kept free = "
            f"at most {max(room, 0) / 1e9:.2f} GB")


def host_problems(cfg: Config, *, local_ranks: int = 1,
                  cgroup_path: str | os.PathLike[str] | None = None) -> list[str]:
    """What about `cfg` does not fit this host (`memory_problem`, `disk_problem`), each
    message starting with the key; empty when all fits. Reads only, never writes."""
    found = (memory_problem(cfg, local_ranks=local_ranks, cgroup_path=cgroup_path),
             disk_problem(cfg))
    return [p for p in found if p]


def check_host(cfg: Config, *, local_ranks: int = 1,
               cgroup_path: str | os.PathLike[str] | None = None) -> None:
    """`ConfigError` with every `host_problems` message, for the launch to refuse before any
    worker starts or anything is written."""
    problems = host_problems(cfg, local_ranks=local_ranks, cgroup_path=cgroup_path)
    if problems:
        raise ConfigError("; ".join(problems))
