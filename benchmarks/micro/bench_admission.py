"""The admission copy: a prompt's chunks from kvtier's CPU tier into the KV pool, the work
SGLang's scheduler thread does when it admits a request with a kvtier hit.

A pool of `--layers` x `--heads` x `--head-dim` (fp32, the CPU demo's shape) holds one prompt of
`--chunks` chunks of `--chunk-size` tokens, stored through a `CacheEngine` (CPU tier only);
then, `--reps` times each, interleaved:

- `batched`: `engine.retrieve(..., hot_only=True)` as shipped: precomputed keys, one CPU-tier
  lease of all chunks, one slot check and one kernel call over all chunks;
- `per-chunk`: the same chunks streamed from the CPU tier and scattered one kernel call (and one
  slot check) per chunk, as the admission copy did before;
- `memcpy`: one `torch` copy of the same number of bytes, contiguous (the floor).

Prints medians and p99 in ms and the ratios to memcpy, and writes JSON.

    .venv/bin/python benchmarks/micro/bench_admission.py [--chunks 168] [--chunk-size 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import closing
from pathlib import Path

import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.memory import KVLayout
from kvtier.storage import StorageManager

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _per_chunk(engine: CacheEngine, storage: StorageManager, keys: list,
               slots: torch.Tensor) -> None:
    # the baseline: the storage manager's stream, a scatter per chunk
    with closing(storage.stream(keys, hot_only=True)) as chunks:
        for key, obj in zip(keys, chunks):
            engine.connector.scatter(obj, slots[key.start:key.end])
            obj.release()


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    tokens = args.chunks * args.chunk_size
    layout = KVLayout.mha(args.layers, args.heads, args.head_dim, torch.float32)
    shape = (2 * tokens + 1, args.heads, args.head_dim)
    pool = [torch.randn(shape) for _ in range(2 * args.layers)]
    connector = SGLangMHAConnector(pool[::2], pool[1::2])
    config = Config(chunk_size=args.chunk_size, max_local_cpu_size=4 * tokens *
                    layout.nbytes(1) / 1e9 + 0.01)
    storage = StorageManager(config, layout)  # the engine's, streamed from directly too
    engine = CacheEngine(config, model_name="bench", layout=layout, connector=connector,
                         storage=storage)
    ids = torch.arange(tokens) % 30000
    assert engine.store(ids, torch.arange(1, tokens + 1)) == tokens
    keys = engine.chunk_keys(ids)
    dst = torch.arange(tokens + 1, 2 * tokens + 1)
    nbytes = layout.nbytes(tokens)
    src_buf, dst_buf = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes,
                                                                         dtype=torch.uint8)
    modes = {
        "batched": lambda: engine.retrieve(ids, dst, hot_only=True, keys=keys),
        "per-chunk": lambda: _per_chunk(engine, storage, keys, dst),
        "memcpy": lambda: dst_buf.copy_(src_buf),
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.reps):
        for name, fn in modes.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    assert all(torch.equal(p[1:tokens + 1], p[tokens + 1:]) for p in pool)
    engine.close()
    storage.close()
    floor = statistics.median(times["memcpy"])
    out = {}
    for name, ts in times.items():
        ts.sort()
        median = statistics.median(ts)
        out[name] = {"median_ms": median * 1e3, "p99_ms": ts[int(0.99 * (len(ts) - 1))] * 1e3,
                     "x_memcpy": median / floor}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=168)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    result = run(args)
    mib = args.chunks * args.chunk_size * 2 * args.layers * args.heads * args.head_dim * 4 / 2**20
    print(f"admission copy: {args.chunks} chunks x {args.chunk_size} tokens, {mib:.1f} MiB, "
          f"{args.reps} reps")
    print("| mode | median ms | p99 ms | x memcpy (median) |\n| --- | ---: | ---: | ---: |")
    for name, r in result.items():
        print(f"| {name} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | {r['x_memcpy']:.2f} |")
    speedup = result["per-chunk"]["median_ms"] / result["batched"]["median_ms"]
    print(f"per-chunk / batched: {speedup:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "bench_admission.json"
    path.write_text(json.dumps({"args": vars(args), "result": result,
                                "per_chunk_over_batched": speedup}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
