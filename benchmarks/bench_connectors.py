"""Gather/scatter throughput of the connector kernels against this machine's memcpy.

Shape: Llama-3-8B per TP rank (32 layers x K and V, 8 KV heads x 128 dims, bf16), one 256-token
chunk = 32 MiB, random slots in a pool of 16k slots (`--contiguous`: one run of consecutive
slots, as a fresh server's allocator hands a request). Implementations: `ops` (the public
`kvtier.connectors.ops` functions, checks included, with the kernel they dispatch to), `cpp`
(the compiled kernels called directly), `torch` (the reference) and `naive` (a per-layer
Python loop with advanced indexing). The baseline is torch `copy_` of a contiguous tensor of
the same size, measured in the same run. GB/s is the median over the rounds, `best` the
fastest round.

    .venv/bin/python benchmarks/bench_connectors.py [--rounds 20] [--pool-slots 16384]
        [--contiguous] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.connectors import build, ops

_C = build.load()  # the compiled kernels; fails loudly when they cannot be built

RESULTS = Path(__file__).parent / "results" / "connectors.json"


def measure(
    cases: dict[str, Callable[[], None]], nbytes: int, rounds: int
) -> dict[str, dict[str, float]]:
    """GB/s (1e9 bytes/s) of each case: median and best over `rounds`.

    The cases run interleaved, one call each per round, so every implementation sees the same
    background load (the machine is shared).
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for i in range(rounds + 2):  # the first two rounds warm caches and thread pools
        # Rotate the order so that no case always follows the same one (cache state).
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            cases[name]()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {
        name: {"gbps": nbytes / statistics.median(t) / 1e9, "best_gbps": nbytes / min(t) / 1e9}
        for name, t in times.items()
    }


def naive_gather(layers: list[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
    for i, layer in enumerate(layers):
        out[i] = layer[slots]


def naive_scatter(src: torch.Tensor, slots: torch.Tensor, layers: list[torch.Tensor]) -> None:
    for i, layer in enumerate(layers):
        layer[slots] = src[i]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    num_layers, hidden, dtype = 2 * args.layers, args.kv_heads * args.head_dim, torch.bfloat16
    layers = [torch.randn(args.pool_slots, hidden).to(dtype) for _ in range(num_layers)]
    slots = (torch.arange(1, args.tokens + 1) if args.contiguous
             else torch.randperm(args.pool_slots)[: args.tokens].contiguous())
    chunk = torch.empty(num_layers, args.tokens, hidden, dtype=dtype)
    src = torch.randn(num_layers, args.tokens, hidden).to(dtype)
    nbytes = chunk.numel() * chunk.element_size()
    kernel = ops.kernel_name()
    cases: dict[str, Callable[[], None]] = {
        "memcpy/torch copy_": lambda: chunk.copy_(src),
        f"gather/ops ({kernel})": lambda: ops.gather(layers, slots, chunk),
        "gather/cpp": lambda: _C.gather(layers, slots, chunk),
        "gather/torch": lambda: ops.reference_gather(layers, slots, chunk),
        "gather/naive": lambda: naive_gather(layers, slots, chunk),
        f"scatter/ops ({kernel})": lambda: ops.scatter(src, slots, layers),
        "scatter/cpp": lambda: _C.scatter(src, slots, layers),
        "scatter/torch": lambda: ops.reference_scatter(src, slots, layers),
        "scatter/naive": lambda: naive_scatter(src, slots, layers),
    }
    speeds = measure(cases, nbytes, args.rounds)
    memcpy = speeds["memcpy/torch copy_"]
    rows = []
    for name, speed in speeds.items():
        op, impl = name.split("/", 1)
        ratio = speed["gbps"] / memcpy["gbps"]
        rows.append({"op": op, "impl": impl, **speed, "ratio_to_memcpy": ratio})
    return {
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "shape": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": "bf16",
            "tokens": args.tokens,
            "pool_slots": args.pool_slots,
            "slots": "contiguous" if args.contiguous else "random",
            "chunk_bytes": nbytes,
            "threads": args.threads,
            "rounds": args.rounds,
        },
        "results": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--pool-slots", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--contiguous", action="store_true",
                        help="consecutive slots instead of random ones")
    report = run(parser.parse_args())
    shape = report["shape"]
    print(f"chunk {shape['chunk_bytes'] / 2**20:.0f} MiB, {shape['slots']} slots, "
          f"{shape['threads']} threads")
    print(f"{'op':<8} {'impl':<12} {'GB/s':>7} {'best':>7} {'x memcpy':>9}")
    for row in report["results"]:
        print(
            f"{row['op']:<8} {row['impl']:<12} {row['gbps']:>7.2f} {row['best_gbps']:>7.2f} "
            f"{row['ratio_to_memcpy']:>9.2f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
