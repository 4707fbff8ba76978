"""The GPU data path against the PCIe limit: engine store and retrieve on CUDA pools.

For MHA (Llama-3-8B per rank: 32 layers x K and V, 8 KV heads x 128 dims, bf16) and MLA
(DeepSeek-like: 61 layers x 576 dims, bf16) pools of `--pool-slots` slots, at each prefix length
of `--tokens`, every round measures, interleaved so that all see the same machine:

- `memcpy d2h` / `memcpy h2d`: a pinned contiguous copy of the same bytes (the baseline);
- `kernel gather` / `kernel scatter`: `host_copy.gather_host`/`scatter_host` alone (random
  slots, 256-token chunks in the pinned arena): the kernel reading or writing host memory
  over PCIe (`KVTIER_GPU_COPY=mapped`);
- `staged gather` / `staged scatter`: `staging.Staging` alone: the same kernel into GPU
  buffers, pipelined with the copy engines' memcpys (the default path);
- `engine store` / `engine retrieve`: `CacheEngine.store` of a new prompt (hashing, allocation,
  the copy, the CPU-tier put) and `CacheEngine.retrieve` of it into another pool, until the
  loaded bytes are in the pool (on the path `KVTIER_GPU_COPY` names, staged by default).

GB/s at the median and at the p99 time, and the median's ratio to the memcpy of the same
direction in the same run. Also the arena's start-up: `--arena-gb` faulted in and registered
(kvtier's way) against `torch.empty(pin_memory=True)` plus first touch. Needs a CUDA GPU.

    python benchmarks/micro/bench_gpu.py [--tokens 4096,16384,32768] [--rounds 10] [--arena-gb 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import write_results
from kvtier.config import Config
from kvtier.connectors import KVConnector, SGLangMHAConnector, SGLangMLAConnector
from kvtier.connectors.staging import Staging, copy_path
from kvtier.engine import CacheEngine
from kvtier.kernels import ops
from kvtier.kernels.host_copy import gather_host, scatter_host
from kvtier.memory import MemoryAllocator
from kvtier.storage import StorageManager

CHUNK = 256


def pools(kind: str, slots: int) -> tuple[KVConnector, KVConnector]:
    def one() -> KVConnector:
        if kind == "mha":
            k = [torch.randn(slots, 8, 128, dtype=torch.bfloat16, device="cuda")
                 for _ in range(32)]
            return SGLangMHAConnector(k, [torch.randn_like(t) for t in k])
        return SGLangMLAConnector([torch.randn(slots, 1, 576, dtype=torch.bfloat16,
                                               device="cuda") for _ in range(61)])
    return one(), one()


def timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def summary(nbytes: int, times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"gbps": nbytes / statistics.median(ordered) / 1e9, "p99_gbps": nbytes / p99 / 1e9}


def run_case(kind: str, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    src, dst = pools(kind, args.pool_slots)
    nbytes = src.layout.nbytes(tokens)
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=3 * nbytes / 1e9, save_tails=False)
    storage = StorageManager(cfg, src.layout)  # a's and b's: b loads what a stored
    a = CacheEngine(cfg, model_name="bench", layout=src.layout, connector=src, storage=storage)
    b = CacheEngine(cfg, model_name="bench", layout=dst.layout, connector=dst, storage=storage)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    objs = [storage.allocator.allocate(src.layout, CHUNK) for _ in range(tokens // CHUNK)]
    planes = src._planes([o for o in objs if o is not None], "objs")
    status = torch.zeros(len(planes), dtype=torch.int32, pin_memory=True)
    staging = Staging(torch.device("cuda", torch.cuda.current_device()))
    times: dict[str, list[float]] = {name: [] for name in (
        "memcpy d2h", "memcpy h2d", "kernel gather", "kernel scatter", "staged gather",
        "staged scatter", "engine store", "engine retrieve")}
    for i in range(args.rounds + 2):  # two warm-up rounds
        toks = torch.randint(0, 30000, (tokens,))
        s_slots = torch.randperm(src.num_slots, device="cuda")[:tokens]
        d_slots = torch.randperm(dst.num_slots, device="cuda")[:tokens]
        cases: dict[str, Callable[[], Any]] = {
            "memcpy d2h": lambda: host.copy_(dev, non_blocking=True),
            "memcpy h2d": lambda: dev.copy_(host, non_blocking=True),
            "kernel gather": lambda s=s_slots: gather_host(src._layers, s, planes, status),
            "kernel scatter": lambda d=d_slots: scatter_host(planes, d, dst._layers, status),
            "staged gather": lambda s=s_slots: staging.gather(src._layers, s, planes, status),
            "staged scatter": lambda d=d_slots: staging.scatter(planes, d, dst._layers, status),
            "engine store": lambda t=toks, s=s_slots: a.store(t, s),
            "engine retrieve": lambda t=toks, d=d_slots: b.retrieve(t, d),
        }
        for name, fn in cases.items():  # store before retrieve: the retrieve loads it
            t = timed(fn)
            if i >= 2:
                times[name].append(t)
        a.tiers.remove(a.chunk_keys(toks))
    for obj in objs:
        if obj is not None:
            obj.release()
    b.close()
    a.close()
    storage.close()
    out = {name: summary(nbytes, t) for name, t in times.items()}
    for name, row in out.items():
        base = out["memcpy d2h" if name in ("memcpy d2h", "kernel gather", "staged gather",
                                            "engine store") else "memcpy h2d"]
        row["x_memcpy"] = row["gbps"] / base["gbps"]
    return {"kind": kind, "tokens": tokens, "bytes": nbytes, "results": out}


def arena_startup(gb: float) -> dict[str, float]:
    size = int(gb * 1e9)
    start = time.perf_counter()
    arena = MemoryAllocator(size, pin=True)
    registered = time.perf_counter() - start
    arena.close()
    del arena
    start = time.perf_counter()
    raw = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    raw.zero_()
    allocated = time.perf_counter() - start
    del raw
    return {"gb": gb, "kvtier_s": registered, "pin_memory_s": allocated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="4096,16384,32768")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--pool-slots", type=int, default=65536)
    parser.add_argument("--kinds", default="mha,mla")
    parser.add_argument("--arena-gb", type=float, default=8.0, help="0: skip the start-up test")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU (torch.cuda.is_available() is False)")
    kernel = ops.prepare()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, kernel {kernel}, "
          f"engine copies {copy_path()}")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "kernel": kernel,
                              "torch": torch.__version__, "copy_path": copy_path(),
                              "cases": []}
    print(f"{'pool':<5}{'tokens':>7}  {'path':<16}{'GB/s':>7}{'p99':>7}{'x memcpy':>10}")
    for kind in args.kinds.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            case = run_case(kind, tokens, args)
            report["cases"].append(case)
            for name, row in case["results"].items():
                print(f"{kind:<5}{tokens:>7}  {name:<16}{row['gbps']:>7.1f}"
                      f"{row['p99_gbps']:>7.1f}{row['x_memcpy']:>10.2f}")
    if args.arena_gb > 0:
        report["arena"] = arena_startup(args.arena_gb)
        print(f"arena {args.arena_gb:g} GB: kvtier {report['arena']['kvtier_s']:.2f}s, "
              f"torch pin_memory {report['arena']['pin_memory_s']:.2f}s")
    write_results("gpu", report)


if __name__ == "__main__":
    main()
