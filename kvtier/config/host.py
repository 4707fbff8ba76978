"""Host checks: whether a `Config` fits the machine it runs on (the arenas of every TP rank
against physical memory and the cgroup limit, the arena now against available memory, disk
space). A file may be sized for a bigger host, so `kvtier check-config` prints these as
warnings and the launch (`check_host`) refuses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.config.schema import Config

__all__ = ["physical_memory_bytes", "available_memory_bytes", "arena_now_problem",
           "cgroup_memory_limit", "memory_problem", "disk_problem", "host_problems",
           "check_host"]


def physical_memory_bytes() -> int:
    """The machine's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


CGROUP_ROOT = "/sys/fs/cgroup"
# Disk headroom kept free for everything else on the filesystem: 5% of it, at most 1 GB (ext4
# already holds back 5% for root, outside the free space counted here).
DISK_RESERVE_FRACTION = 0.05
DISK_RESERVE_BYTES = 10**9
# Memory left free beside a new arena, for the process itself (its threads, allocator slack,
# and with an admission policy other than `always` the write-around buffer: 1/16 of the arena,
# at most 256 MiB, kvtier.engine.around).
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
    its own), each with `MEMORY_HEADROOM_BYTES` beside it for its process (threads, allocator
    slack: what `arena_now_problem` keeps free too), do not fit this host's memory, the
    smaller of physical memory and the cgroup v2 limit (`cgroup_memory_limit(cgroup_path)`);
    None when they fit. One rank is checked too: a single arena larger than the host is
    refused here, at launch (`check_host`), and only warned about by `check-config`."""
    if local_ranks < 1:
        raise ValueError(f"local_ranks must be >= 1, got {local_ranks}")
    limit, what = physical_memory_bytes(), "physical memory"
    cgroup = cgroup_memory_limit(cgroup_path)
    if cgroup is not None and cgroup < limit:
        limit, what = cgroup, "cgroup memory limit (memory.max)"
    arenas = cfg.max_local_cpu_size * 1e9 * local_ranks
    headroom = MEMORY_HEADROOM_BYTES * local_ranks
    if arenas + headroom <= limit:
        return None
    per_rank = max(0.0, limit / local_ranks - MEMORY_HEADROOM_BYTES)
    return (f"max_local_cpu_size: {cfg.max_local_cpu_size:g} GB x {local_ranks} local rank(s) "
            f"= {arenas / 1e9:.2f} GB of arenas (each TP rank allocates its own), with "
            f"{MEMORY_HEADROOM_BYTES / 1e9:.2f} GB kept free beside each, is more than this "
            f"host's {what} of {limit / 1e9:.2f} GB: at most {per_rank / 1e9:.2f} GB per rank")


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
                  cgroup_path: str | os.PathLike[str] | None = None,
                  disk: bool = True) -> list[str]:
    """What about `cfg` does not fit this host (`memory_problem`, and with `disk`
    `disk_problem`), each message starting with the key; empty when all fits. Reads only,
    never writes."""
    found = (memory_problem(cfg, local_ranks=local_ranks, cgroup_path=cgroup_path),
             disk_problem(cfg) if disk else None)
    return [p for p in found if p]


def check_host(cfg: Config, *, local_ranks: int = 1,
               cgroup_path: str | os.PathLike[str] | None = None) -> None:
    """`ConfigError` with every `host_problems` message, for the launch to refuse before any
    worker starts or anything is written."""
    problems = host_problems(cfg, local_ranks=local_ranks, cgroup_path=cgroup_path)
    if problems:
        raise ConfigError("; ".join(problems))
