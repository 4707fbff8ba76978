"""Hit rate on a production request trace, replayed through kvtier's own storage manager and
tiers, beside LRU and Belady's offline optimum computed from the same file (`bounds`).

Each block id becomes 512 token ids derived from it (id * 512 + 0..511), keyed by kvtier's
chained hashes (`KeyBuilder`, `chunk_size: 512`), so requests that share a chain share keys as
they would in a server. The layout is one layer, one KV head, head_dim 1, float32: a chunk is
4096 bytes, one arena alignment unit, so a CPU tier of C tokens is an arena of C // 512
chunks, exactly (the disk tier counts its record headers too). A request:

1. arrives: `StorageManager.get` of its keys walks the tiers (promoting lower-tier hits into
   the CPU tier) and stops at the first miss; the hit is those chunks x 512 tokens, capped at
   the request's `input_length`;
2. is stored as the serving engine stores a computed prefix (`kvtier.engine.saving`): arena
   objects for the chunks from the first one the CPU tier lacks (each allocation may evict),
   then `put`; with a disk tier, its queued writes are flushed before the next request.

The hit rate is the hit tokens over all input tokens; per-tier hits, stored and evicted chunks
and bytes written come from the manager's counters (all of them are in the JSON's `stats`). The
LRU and Belady columns are caches of the CPU tier's capacity alone, with a disk tier too.

A policy is `EVICTION[+ADMISSION]`, the config's `eviction_policy` and `admission_policy`
(`lru`, `arc`; `always`, `second_hit`: docs/policies.md); `--policy` takes several, comma-
separated, each replayed at every capacity. Stores go through `StorageManager.admit` first.

    python -m benchmarks.traces.replay --trace FILE \\
        --capacity-tokens 1e5,1e6,3e6,1e7 [--policy lru,lru+second_hit] [--disk-tokens N] \\
        [--limit N] \\
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import RESULTS
from benchmarks.traces.bounds import belady, infinite, leaf_lru
from benchmarks.traces.trace import BLOCK, Request, hit_tokens, input_tokens, load
from kvtier.backends.record import expected_header_len
from kvtier.config import Config
from kvtier.config.names import ADMISSION_POLICIES, ALWAYS, EVICTION_POLICIES
from kvtier.keys import KeyBuilder
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease
from kvtier.storage import StorageManager

__all__ = ["POLICIES", "replay", "run"]

LAYOUT = KVLayout.mha(1, 1, 1, torch.float32)
CHUNK_BYTES = LAYOUT.nbytes(BLOCK)  # 4096: the arena's alignment, so chunks tile it exactly
POLICIES = tuple(e if a == ALWAYS else f"{e}+{a}"
                 for e in EVICTION_POLICIES for a in ADMISSION_POLICIES)
_OFFSETS = np.arange(BLOCK, dtype=np.uint64)


def replay(requests: list[Request], capacity_tokens: int, policy: str = "lru",
           disk_tokens: int = 0) -> dict[str, Any]:
    """One replay of `requests` through a fresh manager with a CPU tier of `capacity_tokens`
    (and a disk tier of `disk_tokens`, in a temporary directory, when positive)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
    eviction, _, admission = policy.partition("+")
    chunks = capacity_tokens // BLOCK
    if chunks < 1:
        raise ValueError(f"capacity_tokens must hold one {BLOCK}-token block, got "
                         f"{capacity_tokens}")
    builder = KeyBuilder(model="trace", fingerprint=LAYOUT.fingerprint(BLOCK), chunk_size=BLOCK)
    with tempfile.TemporaryDirectory(prefix="kvtier-trace-") as tmp:
        disk: dict[str, Any] = {}
        if disk_tokens > 0:
            probe = builder.keys_from_bytes(bytes(BLOCK * 4))[0]
            record = expected_header_len(probe) + CHUNK_BYTES
            disk = {"local_disk": tmp,
                    "max_local_disk_size": disk_tokens // BLOCK * record / 1e9}
        config = Config(chunk_size=BLOCK, max_local_cpu_size=chunks * CHUNK_BYTES / 1e9,
                        eviction_policy=eviction, admission_policy=admission or ALWAYS, **disk)
        manager = StorageManager(config, LAYOUT, MemoryAllocator(chunks * CHUNK_BYTES, pin=False))
        manager.counters.declare("store_no_memory")  # as the engine does
        try:
            start = time.perf_counter()
            hits = sum(_one(manager, builder, req, flush=bool(disk)) for req in requests)
            seconds = time.perf_counter() - start
            stats = manager.stats()
        finally:
            manager.close()
    total = input_tokens(requests)
    tiers = {"cpu": _tier(stats, "cpu", stats.get("cpu.puts", 0) * CHUNK_BYTES)}
    if disk:  # writes the disk tier refused, e.g. a chunk whose prefix it had evicted
        tiers["disk"] = {**_tier(stats, "disk", stats.get("disk.put_bytes", 0)),
                         "writes_lost": int(stats.get("disk.writes_lost", 0))}
    return {"capacity_tokens": capacity_tokens, "disk_tokens": disk_tokens, "policy": policy,
            "hit_tokens": hits, "hit_rate": hits / total if total else 0.0,
            "chunks_put": stats.get("chunks_put", 0), "tiers": tiers,
            "store_no_memory": stats.get("store_no_memory", 0), "seconds": round(seconds, 2),
            "stats": stats}  # every counter and gauge of the manager and its tiers, at the end


def _one(manager: StorageManager, builder: KeyBuilder, req: Request, *, flush: bool) -> int:
    """One request: its hit (tokens), then its chunks stored as the engine stores them."""
    ids = np.asarray(req.blocks, dtype=np.uint64)
    tokens = (ids[:, None] * BLOCK + _OFFSETS).astype("<u4")  # ids < 2**23: checked in run
    keys = builder.keys_from_bytes(memoryview(tokens.tobytes()))
    with manager.get(keys) as got:
        n = len(got)
    todo = keys[manager.contains(keys, hot_only=True):]
    todo = todo[:manager.admit(todo)]
    objs: list[MemoryObj] = []
    with lease(objs):
        for _ in todo:
            obj = manager.allocator.allocate(LAYOUT, BLOCK)
            if obj is None:
                manager.counters.inc("store_no_memory")
                break
            objs.append(obj)
        manager.put(todo[:len(objs)], objs)
    if flush:
        manager.flush()
    return hit_tokens(req, n)


def _tier(stats: dict[str, float], name: str, bytes_written: float) -> dict[str, int]:
    # `puts` counts promotions from a lower tier too; `evictions` what the tier let go of.
    return {"hit_chunks": int(stats.get(f"{name}.hit_chunks", 0)),
            "stored_chunks": int(stats.get(f"{name}.puts", 0)),
            "evicted_chunks": int(stats.get(f"{name}.evictions", 0)),
            "bytes_written": int(bytes_written)}


def run(trace: Path, capacities: list[int], policy: str = "lru", disk_tokens: int = 0,
        limit: int | None = None) -> dict[str, Any]:
    """Every capacity replayed through kvtier under each of the comma-separated `policy`
    names, with the bounds of the same requests."""
    names = policies(policy)
    requests = load(trace, limit)
    if requests and max(max(r.blocks) for r in requests) * BLOCK + BLOCK > 2**32:
        raise ValueError(f"{trace}: block ids must stay below 2**23 to become uint32 tokens")
    total = input_tokens(requests)
    runs = []
    for capacity in capacities:
        start = time.perf_counter()
        bounds = {"lru_hit_rate": leaf_lru(requests, capacity // BLOCK) / total,
                  "belady_hit_rate": belady(requests, capacity // BLOCK) / total,
                  "bounds_seconds": round(time.perf_counter() - start, 2)}
        for name in names:
            runs.append({**replay(requests, capacity, name, disk_tokens), **bounds})
    return {"trace": str(trace), "requests": len(requests), "input_tokens": total,
            "infinite_hit_rate": infinite(requests) / total if total else 0.0, "runs": runs}


def policies(names: str) -> list[str]:
    """The policy names of a comma-separated list; `ValueError` naming an unknown one."""
    out = [n.strip() for n in names.split(",") if n.strip()]
    for name in out:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['trace']}: {result['requests']} requests, {result['input_tokens']} "
             f"input tokens; no capacity limit: {result['infinite_hit_rate']:.1%}",
             "| capacity (tokens) | kvtier | LRU | Belady | kvtier/LRU | kvtier/Belady | s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["runs"]:
        disk = f" + disk {r['disk_tokens']:.0e}" if r["disk_tokens"] else ""
        lines.append(
            f"| {r['capacity_tokens']:.0e}{disk} | {r['hit_rate']:.1%} ({r['policy']}) "
            f"| {r['lru_hit_rate']:.1%} | {r['belady_hit_rate']:.1%} "
            f"| {_ratio(r['hit_rate'], r['lru_hit_rate'])} "
            f"| {_ratio(r['hit_rate'], r['belady_hit_rate'])} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--capacity-tokens", default="1e5,1e6,3e6,1e7",
                        help="CPU tier sizes in tokens, comma-separated (1e6 is fine)")
    parser.add_argument("--policy", default="lru",
                        help=f"comma-separated, each one of {', '.join(POLICIES)}")
    parser.add_argument("--disk-tokens", type=float, default=0,
                        help="add a disk tier of this many tokens (a temporary directory)")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--json", type=Path, default=RESULTS / "trace_replay.json")
    args = parser.parse_args()
    capacities = [int(float(c)) for c in args.capacity_tokens.split(",") if c.strip()]
    try:
        policies(args.policy)
    except ValueError as e:
        parser.error(str(e))
    start = time.perf_counter()
    result = run(args.trace, capacities, args.policy, int(args.disk_tokens), args.limit)
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(table(result))
    print(f"{result['seconds']:.1f} s in all")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
