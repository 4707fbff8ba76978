"""Gather/scatter throughput of the connector kernels against this machine's memcpy.

Shape: Llama-3-8B per TP rank (32 layers x K and V, 8 KV heads x 128 dims, bf16), one 256-token
chunk = 32 MiB, random slots in a pool of 16k slots (`--contiguous`: one run of consecutive
slots, as a fresh server's allocator hands a request; `--page-size N`: random pages of N
consecutive slots, as SGLang's paged allocator hands them). Implementations: `ops` (the public
`kvtier.kernels.ops` functions, checks included, with the kernel they dispatch to), `cpp`
(the compiled kernels called directly), `torch` (the reference) and `naive` (a per-layer
Python loop with advanced indexing). `engine` stores the chunk from the pool into a CPU tier
and retrieves it back through `kvtier.engine.CacheEngine` (keys, lookup, arena, connector,
kernel), on the same pool and slots; `--chunks N` makes each call a prompt of N chunks (the
kernel rows then copy all N chunks' rows in one call). The baseline is torch `copy_` of a
contiguous tensor of the same size with the same threads, measured in the same run; the engine
rows are also given against the kernel alone (`cpp`). GB/s is the median over the rounds, `p99`
the rate at the 99th percentile of the times (the slowest round below 100 rounds), `best` the
fastest round.

The pool sits on transparent huge pages where the kernel grants them, as the SGLang integration
puts a CPU pool (`kvtier.connectors.hugepages`); `--no-huge-pages` leaves it on 4 KiB pages, and
`--compare-pages` adds the kernel rows on a second pool of 4 KiB pages in the same run.

    .venv/bin/python benchmarks/micro/bench_connectors.py [--rounds 20] [--pool-slots 16384]
        [--contiguous | --page-size N] [--threads 2] [--chunks 1] [--no-engine]
        [--no-huge-pages | --compare-pages]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.connectors import hugepages
from kvtier.kernels import build, ops

_C = build.load()  # the compiled kernels; fails loudly when they cannot be built

RESULTS = Path(__file__).resolve().parents[1] / "results" / "connectors.json"
MEMCPY = "memcpy/torch copy_"
# The engine rows' second baseline: the kernel call they make, in the same run.
KERNEL_OF = {"store/engine": "gather/cpp", "retrieve/engine": "scatter/cpp"}


def measure(
    cases: dict[str, Callable[[], None]], nbytes: int, rounds: int,
    setups: dict[str, Callable[[], None]] | None = None, flush_bytes: int = 0,
) -> dict[str, dict[str, float]]:
    """GB/s (1e9 bytes/s) of each case: median, p99 and best over `rounds`.

    The cases run interleaved, one call each per round, in a new random order each round, so
    every implementation sees the same background load (the machine is shared) and none always
    follows the same one. `setups[name]` runs untimed before each call of that case; then, with
    `flush_bytes`, an untimed sweep over that many bytes leaves the caches cold: otherwise a
    case that reads the pool rows the one before it just read (the same slots) runs from the
    cache, which serving never does.
    """
    setups = setups or {}
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    order = random.Random(0)
    sweep = torch.empty(flush_bytes // 8, dtype=torch.int64) if flush_bytes else None
    for i in range(rounds + 2):  # the first two rounds warm thread pools and page tables
        order.shuffle(names)
        for name in names:
            if name in setups:
                setups[name]()
            if sweep is not None:
                sweep.add_(1)  # reads and writes every line: the pool and chunk lines go
            start = time.perf_counter()
            cases[name]()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: {"gbps": nbytes / statistics.median(t) / 1e9,
                   "p99_gbps": nbytes / p99(t) / 1e9,
                   "best_gbps": nbytes / min(t) / 1e9} for name, t in times.items()}


def _default_flush_mb() -> float:
    """Twice this machine's last-level cache in MiB (64 if it cannot be read)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = index.read_text().strip()
        if text[:-1].isdigit() and text[-1] in "KM":
            sizes.append(int(text[:-1]) / (1024 if text[-1] == "K" else 1))
    return 2 * max(sizes) if sizes else 64.0


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank): the largest value below 100 values."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def naive_gather(layers: list[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
    for i, layer in enumerate(layers):
        out[i] = layer[slots]


def naive_scatter(src: torch.Tensor, slots: torch.Tensor, layers: list[torch.Tensor]) -> None:
    for i, layer in enumerate(layers):
        layer[slots] = src[i]


def make_slots(args: argparse.Namespace) -> torch.Tensor:
    tokens = args.tokens * args.chunks
    if args.contiguous:
        return torch.arange(1, tokens + 1)
    page = args.page_size
    pages = torch.randperm(args.pool_slots // page)[: -(-tokens // page)]
    return (pages[:, None] * page + torch.arange(page)).flatten()[:tokens].contiguous()


def engine_cases(
    args: argparse.Namespace, layers: list[torch.Tensor], slots: torch.Tensor
) -> tuple[dict[str, Callable[[], None]], dict[str, Callable[[], None]], Any]:
    """Store and retrieve of one chunk through a CPU-tier-only engine on the bench's pool:
    the cases, their untimed set-ups (the store's chunk is dropped before each store, or it
    would be skipped as held) and the engine (close it)."""
    from kvtier.config import Config
    from kvtier.connectors import SGLangMHAConnector
    from kvtier.engine import CacheEngine

    heads = [layer.view(args.pool_slots, args.kv_heads, args.head_dim) for layer in layers]
    connector = SGLangMHAConnector(heads[: args.layers], heads[args.layers :])
    prompt = args.tokens * args.chunks
    config = Config(chunk_size=args.tokens,
                    max_local_cpu_size=(2 * prompt + 2) * connector.layout.nbytes(1) / 1e9)
    engine = CacheEngine(config, model_name="bench-connectors", layout=connector.layout,
                         connector=connector)
    stored = torch.randint(0, 128_000, (prompt,), generator=torch.Generator().manual_seed(1))
    loaded = stored + 1  # another prompt, stored once, retrieved every round
    assert engine.store(loaded, slots) == prompt

    def store() -> None:
        assert engine.store(stored, slots) == prompt

    def retrieve() -> None:
        assert engine.retrieve(loaded, slots) == prompt

    setups = {"store/engine": lambda: engine.tiers.remove(engine.chunk_keys(stored))}
    return {"store/engine": store, "retrieve/engine": retrieve}, setups, engine


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    num_layers, hidden, dtype = 2 * args.layers, args.kv_heads * args.head_dim, torch.bfloat16
    def pool() -> list[torch.Tensor]:
        return [torch.randn(args.pool_slots, hidden).to(dtype) for _ in range(num_layers)]

    layers = pool()
    slots = make_slots(args)
    chunk = torch.empty(num_layers, args.tokens * args.chunks, hidden, dtype=dtype)
    src = torch.randn(num_layers, args.tokens * args.chunks, hidden).to(dtype)
    pages = hugepages.back(layers, collapse=True) if args.huge_pages else None
    nbytes = chunk.numel() * chunk.element_size()
    kernel = ops.kernel_name()
    cases: dict[str, Callable[[], None]] = {
        MEMCPY: lambda: chunk.copy_(src),
        f"gather/ops ({kernel})": lambda: ops.gather(layers, slots, chunk),
        "gather/cpp": lambda: _C.gather(layers, slots, chunk),
        "gather/torch": lambda: ops.reference_gather(layers, slots, chunk),
        "gather/naive": lambda: naive_gather(layers, slots, chunk),
        f"scatter/ops ({kernel})": lambda: ops.scatter(src, slots, layers),
        "scatter/cpp": lambda: _C.scatter(src, slots, layers),
        "scatter/torch": lambda: ops.reference_scatter(src, slots, layers),
        "scatter/naive": lambda: naive_scatter(src, slots, layers),
    }
    if args.compare_pages:
        small = pool()
        cases["gather/cpp 4k pages"] = lambda: _C.gather(small, slots, chunk)
        cases["scatter/cpp 4k pages"] = lambda: _C.scatter(src, slots, small)
    setups: dict[str, Callable[[], None]] = {}
    engine = None
    if args.engine:
        more, setups, engine = engine_cases(args, layers, slots)
        cases.update(more)
    try:
        speeds = measure(cases, nbytes, args.rounds, setups, int(args.flush_mb * 2**20))
    finally:
        if engine is not None:
            engine.close()
    memcpy = speeds[MEMCPY]
    rows = []
    for name, speed in speeds.items():
        op, impl = name.split("/", 1)
        row = {"op": op, "impl": impl, **speed, "ratio_to_memcpy": speed["gbps"] / memcpy["gbps"]}
        if name in KERNEL_OF:
            row["ratio_to_kernel"] = speed["gbps"] / speeds[KERNEL_OF[name]]["gbps"]
        rows.append(row)
    slot_kind = ("contiguous" if args.contiguous else "random" if args.page_size == 1
                 else f"random pages of {args.page_size}")
    return {
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "shape": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": "bf16",
            "tokens": args.tokens,
            "chunks_per_call": args.chunks,
            "pool_slots": args.pool_slots,
            "slots": slot_kind,
            "chunk_bytes": nbytes // args.chunks,
            "call_bytes": nbytes,
            "threads": args.threads,
            "rounds": args.rounds,
            "flush_mb": args.flush_mb,
            "huge_pages": pages._asdict() if pages else None,
        },
        "results": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--chunks", type=int, default=1,
                        help="chunks per engine call (a prompt of this many chunks)")
    parser.add_argument("--pool-slots", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--flush-mb", type=float, default=_default_flush_mb(),
                        help="sweep this many MiB before each timed call, so it starts with cold "
                             "caches (default: twice the last-level cache; 0: warm caches)")
    parser.add_argument("--contiguous", action="store_true",
                        help="consecutive slots instead of random ones")
    parser.add_argument("--page-size", type=int, default=1,
                        help="random pages of this many consecutive slots")
    parser.add_argument("--no-engine", dest="engine", action="store_false",
                        help="leave out the engine's store and retrieve")
    parser.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                        help="move the pool onto huge pages (default: on)")
    parser.add_argument("--compare-pages", action="store_true",
                        help="add the kernel rows on a pool of 4 KiB pages")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON report")
    args = parser.parse_args()
    if args.page_size < 1 or args.pool_slots % args.page_size:
        parser.error("--page-size must be a positive divisor of --pool-slots")
    if args.compare_pages and not args.huge_pages:
        parser.error("--compare-pages compares against the huge-page pool: drop --no-huge-pages")
    if args.chunks < 1 or args.tokens * args.chunks > args.pool_slots:
        parser.error("--chunks must be positive, with --tokens x --chunks <= --pool-slots")
    report = run(args)
    shape = report["shape"]
    print(f"{shape['chunks_per_call']} x {shape['chunk_bytes'] / 2**20:.0f} MiB chunks per call, "
          f"{shape['slots']} slots, "
          f"{shape['threads']} threads, {shape['rounds']} rounds")
    if shape["huge_pages"]:
        print("huge pages:", hugepages.HugePages(**shape["huge_pages"]).describe())
    print(f"{'op':<9} {'impl':<20} {'GB/s':>7} {'p99':>7} {'best':>7} {'x memcpy':>9} "
          f"{'x kernel':>9}")
    for row in report["results"]:
        kernel = f"{row['ratio_to_kernel']:>9.2f}" if "ratio_to_kernel" in row else ""
        print(
            f"{row['op']:<9} {row['impl']:<20} {row['gbps']:>7.2f} {row['p99_gbps']:>7.2f} "
            f"{row['best_gbps']:>7.2f} {row['ratio_to_memcpy']:>9.2f} {kernel}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
