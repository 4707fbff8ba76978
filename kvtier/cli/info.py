"""`kvtier info`: versions, the copy kernel and each tier's state, read-only (the disk tier's
directory is inspected, never created, written or cleaned; Redis is only pinged), so it may run
against the tiers of a serving instance."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform

from kvtier.config import load_config
from kvtier.config.tiers import load_attr, tier_spec
from kvtier.errors import KVTierError

__all__ = ["info"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _sglang_internals() -> str:
    """Whether the installed SGLang still has every internal kvtier reaches for."""
    try:
        from kvtier.integration.sglang.boundary import sglang_canary

        failed = sglang_canary.check_all()
    except Exception as exc:  # an SGLang that does not even import is worth one line here
        return f"cannot check: {type(exc).__name__}: {exc}"
    if not failed:
        return f"all {len(sglang_canary.REACH_INS)} present"
    return f"{len(failed)} MOVED (kvtier may misbehave): " + "; ".join(failed)


def info(args: argparse.Namespace) -> int:
    """Versions, the copy kernel and each tier's state. Read-only: the disk directory is
    inspected (never created, written or cleaned), Redis is only pinged, so `info` may run
    against the tiers of a serving instance."""
    import torch

    from kvtier.backends import BackendContext, create_backend
    from kvtier.kernels import ops
    from kvtier.memory import KVLayout, MemoryAllocator

    cfg = load_config(args.file)
    kernel, why = ops.kernel_status()  # the reason goes in the table, not in a log line
    rows = [("kvtier", _version("kvtier")), ("python", platform.python_version()),
            ("torch", torch.__version__), ("cuda", str(torch.cuda.is_available())),
            ("redis-py", _version("redis")), ("sglang", _version("sglang")),
            ("copy kernel", f"{kernel}: {why}" if why else kernel)]
    if getattr(args, "sglang", False) and _version("sglang") != "not installed":
        rows.append(("sglang internals", _sglang_internals()))  # imports SGLang: seconds
    # Reachability: build the CPU and Redis tiers against a tiny arena and ask for their stats
    # (the CPU tier is memory only; the Redis tier's start-up sends read commands only).
    alloc = MemoryAllocator(1 << 20, pin=False)
    ctx = BackendContext(cfg, KVLayout.mha(1, 1, 16, torch.float16), alloc)
    for name in cfg.tiers:
        try:
            inventory = tier_spec(name).inventory  # a tier may say what it holds unopened
            stats = load_attr(inventory).peek(cfg) if inventory else None
            if stats is None:
                tier = create_backend(name, ctx)
                stats = tier.stats()
                tier.close()
            # A tier that cannot reach its server starts "down" (and serves misses), not raises.
            health = "DOWN (serving misses)" if stats.get("down") else "ok"
            shown = [k for k in ("entries", "bytes", "capacity_bytes") if k in stats]
            status = health + " " + ", ".join(
                f"{k.removesuffix('_bytes')}={_size(stats[k])}" if k.endswith("bytes")
                else f"{k}={stats[k]:g}" for k in shown)
        except (KVTierError, OSError) as exc:
            status = f"UNAVAILABLE: {exc}"
        rows.append((f"tier {name}", status))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _size(nbytes: float) -> str:
    """`nbytes` in human units (decimal, as max_local_cpu_size and friends are in GB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:g} B"
