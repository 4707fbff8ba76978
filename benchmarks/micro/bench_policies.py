"""The serving-path cost of the CPU tier's policies (`eviction_policy`, `admission_policy`): a
store and a lookup through the `StorageManager`, each policy beside `lru` + `always` without a
tenant share (kvtier's behaviour before policies and shares) in the same run; `+share0.5` rows
keep `tenant_max_fraction: 0.5`'s books (`--tenants noisy`: and evict by it).

Small chunks (one layer, one KV head, head_dim 1, float32, 512 tokens: 2 KiB), so the policy's
bookkeeping is as large a share of a call as it can be (real chunks are megabytes: the copy
dwarfs it). The arena holds `--arena-chunks` chunks and starts full, so every store evicts:

- `store`: a prompt of `--chunks` chunks, each time a new one, as the engine stores it
  (`StorageManager.admit`, then arena objects, each allocation evicting, then `put`);
- `lookup`: `StorageManager.get(hot_only=True)` of a held prompt of `--chunks` chunks (a CPU
  tier hit, touching every chunk), the newest quarter of the prompts held, in turn (timed
  before the stores).

Each round fills one manager per policy, then times a block of calls on each in turn (the
order rotates round by round) with the calling thread's CPU clock (`time.thread_time`: what
the call costs, not what a busy host's other processes take from it). The table shows the
fastest block's time a call and its ratio to the fastest `lru` + `always` block, then the
median and the 99th percentile over rounds of the same-round ratios.
A `second_hit` store of a first-seen prompt into a full arena is refused: it copies nothing,
so its store column measures the refusal, not a store.

    python -m benchmarks.micro.bench_policies [--rounds 7] [--calls 400] [--chunks 8] \\
        [--model --arena-chunks 256] [--tenants noisy]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any, NamedTuple

import torch

from benchmarks.common import RESULTS
from kvtier.config import Config
from kvtier.keys import ChunkKey, KeyBuilder
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj, lease
from kvtier.storage import StorageManager

__all__ = ["POLICIES", "run"]

TOKENS = 512
LAYOUT = KVLayout.mha(1, 1, 1, torch.float32)
CHUNK_BYTES = 4096  # one arena unit
# `--model`: SmolLM2-135M's KV (30 layers, 3 KV heads, head_dim 64, bf16) in 64-token chunks
# (1.4 MiB), each store copying its chunks' bytes in from a pool as the engine's gather does.
MODEL_TOKENS = 64
MODEL_LAYOUT = KVLayout.mha(30, 3, 64, torch.bfloat16)
# (eviction_policy, admission_policy, tenant_max_fraction): `lru+always` without a share (1:
# no tenant bookkeeping) is kvtier before policies and shares; `+share0.5` rows track tenants.
POLICIES = (("lru", "always", 1.0), ("lru", "always", 0.5), ("arc", "always", 1.0),
            ("arc", "always", 0.5), ("lru", "second_hit", 0.5), ("arc", "second_hit", 0.5),
            ("lfuda", "always", 1.0), ("lfuda", "adaptive", 1.0), ("lfuda", "adaptive", 0.5))
BASE = "lru+always"
# `--tenants noisy`: three prompts of four are one tenant's, the fourth another's, so the
# noisy one is over a 0.5 share and evicts its own chunks, walking past the quiet one's.
TENANTS = ("one", "noisy")
_SEEDS = itertools.count()


class Shape(NamedTuple):
    """The chunks of a run: their layout and tokens, and the bytes a store copies (or None)."""

    layout: KVLayout
    tokens: int
    pool: torch.Tensor | None

    @property
    def arena_unit(self) -> int:
        return -(-self.layout.nbytes(self.tokens) // 4096) * 4096

    def builder(self) -> KeyBuilder:
        return KeyBuilder(model="bench", fingerprint=self.layout.fingerprint(self.tokens),
                          chunk_size=self.tokens)


def _shape(model: bool) -> Shape:
    if not model:
        return Shape(LAYOUT, TOKENS, None)
    pool = torch.randn(MODEL_LAYOUT.shape(MODEL_TOKENS)).to(MODEL_LAYOUT.dtype)
    return Shape(MODEL_LAYOUT, MODEL_TOKENS, pool)


def _name(policy: tuple[str, str, float]) -> str:
    return "+".join(policy[:2]) + ("" if policy[2] == 1 else f"+share{policy[2]:g}")


def _prompt(builder: KeyBuilder, chunks: int, tenants: str = "one") -> list[ChunkKey]:
    seed = next(_SEEDS)
    tokens = builder.chunk_size
    keys = builder.keys(torch.arange(chunks * tokens) + seed * chunks * tokens)
    if tenants == "one":
        return keys
    salt = "quiet" if seed % 4 == 0 else "noisy"
    return [k._replace(salt=salt) for k in keys]


def _store(manager: StorageManager, keys: list[ChunkKey],
           pool: torch.Tensor | None = None) -> None:
    todo = keys[manager.contains(keys, hot_only=True):]
    todo = todo[:manager.admit(todo)]
    objs: list[MemoryObj] = []
    with lease(objs):
        for key in todo:
            obj = manager.allocator.allocate(manager.layout, key.num_tokens)
            if obj is None:
                break
            if pool is not None:
                obj.tensor.copy_(pool)  # the chunk's KV, as the engine's gather copies it
            objs.append(obj)
        manager.put(todo[:len(objs)], objs)


def _manager(policy: tuple[str, str, float], arena_chunks: int, shape: Shape,
             ) -> StorageManager:
    size = arena_chunks * shape.arena_unit
    config = Config(chunk_size=shape.tokens, max_local_cpu_size=size / 1e9,
                    eviction_policy=policy[0], admission_policy=policy[1],
                    tenant_max_fraction=policy[2])
    return StorageManager(config, shape.layout, MemoryAllocator(size, pin=False))


def _filled(policy: tuple[str, str, float], arena_chunks: int, chunks: int, shape: Shape,
            builder: KeyBuilder, tenants: str) -> tuple[StorageManager, list[list[ChunkKey]]]:
    """A manager whose arena is full of prompts, and the newest quarter of them (to look up)."""
    manager = _manager(policy, arena_chunks, shape)
    held = [_prompt(builder, chunks, tenants) for _ in range(arena_chunks // chunks)]
    for keys in held:
        _store(manager, keys, shape.pool)
    return manager, held[-max(1, len(held) // 4):]


def _block(manager: StorageManager, looked: list[list[ChunkKey]], fresh: list[list[ChunkKey]],
           pool: torch.Tensor | None) -> dict[str, float]:
    """CPU seconds of this thread a call: lookups of held prompts, then stores of new ones."""
    start = time.thread_time()
    for i in range(len(fresh)):
        with manager.get(looked[i % len(looked)], hot_only=True) as got:
            assert got, "a held prompt missed"
    lookup = (time.thread_time() - start) / len(fresh)
    start = time.thread_time()
    for keys in fresh:
        _store(manager, keys, pool)
    return {"store": (time.thread_time() - start) / len(fresh), "lookup": lookup}


def run(rounds: int, calls: int, chunks: int, arena_chunks: int,
        model: bool = False, tenants: str = "one") -> dict[str, Any]:
    shape = _shape(model)
    builder = shape.builder()
    names = [_name(p) for p in POLICIES]
    samples: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(rounds):
        made = {n: _filled(p, arena_chunks, chunks, shape, builder, tenants)
                for n, p in zip(names, POLICIES)}
        try:
            for n in names[r % len(names):] + names[:r % len(names)]:  # the order rotates
                manager, looked = made[n]
                fresh = [_prompt(builder, chunks, tenants) for _ in range(calls)]
                samples[n].append(_block(manager, looked, fresh, shape.pool))
        finally:
            for manager, _ in made.values():
                manager.close()
    base = samples[BASE]
    rows = []
    for name, got in samples.items():
        row: dict[str, Any] = {"policy": name}
        for op in ("store", "lookup"):
            # The fastest block: what a call costs when nothing else took the caches (a busy
            # host's interference only ever adds), then the median of the same-round ratios.
            best = min(s[op] for s in got)
            row[f"{op}_us"] = round(best * 1e6, 2)
            row[f"{op}_ratio"] = round(best / min(b[op] for b in base), 3)
            ratios = [s[op] / b[op] for s, b in zip(got, base)]
            row[f"{op}_ratio_median"] = round(statistics.median(ratios), 3)
            # The same-round ratios' 99th percentile (the worst round, with few rounds).
            row[f"{op}_ratio_p99"] = round(statistics.quantiles(ratios, n=100)[98]
                                           if len(ratios) > 1 else ratios[0], 3)
        rows.append(row)
    return {"rounds": rounds, "calls": calls, "chunks": chunks, "arena_chunks": arena_chunks,
            "chunk_bytes": shape.layout.nbytes(shape.tokens), "copies": model, "tenants": tenants,
            "clock": "thread_time", "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--chunks", type=int, default=8, help="chunks a prompt")
    parser.add_argument("--arena-chunks", type=int, default=2048)
    parser.add_argument("--model", action="store_true",
                        help="SmolLM2-135M chunks of 64 tokens (1.4 MiB), copied in by a store")
    parser.add_argument("--tenants", choices=TENANTS, default="one",
                        help="one tenant, or a noisy one storing 3 prompts of 4 and a quiet one")
    parser.add_argument("--json", default=str(RESULTS / "bench_policies.json"))
    args = parser.parse_args()
    result = run(args.rounds, args.calls, args.chunks, args.arena_chunks, args.model,
                 args.tenants)
    print("| policy | store (us) | store / lru | median ratio | p99 ratio | lookup (us) "
          "| lookup / lru | median ratio | p99 ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in result["rows"]:
        print(f"| {r['policy']} | {r['store_us']:.1f} | {r['store_ratio']:.3f}x "
              f"| {r['store_ratio_median']:.3f}x | {r['store_ratio_p99']:.3f}x "
              f"| {r['lookup_us']:.1f} | {r['lookup_ratio']:.3f}x "
              f"| {r['lookup_ratio_median']:.3f}x | {r['lookup_ratio_p99']:.3f}x |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
