"""`kvtier bench`: end-to-end throughput on a Llama-3-8B KV shape, against this machine's memcpy.

Every figure is reported next to a baseline measured in the same run (plain memcpy of the same
bytes), because absolute numbers on shared machines are noise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector, ops
from kvtier.engine import CacheEngine
from kvtier.keys import KeyBuilder
from kvtier.memory import KVLayout

__all__ = ["run_bench", "LLAMA3_8B"]

LLAMA3_8B = KVLayout.mha(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def _best_of(fn: Callable[[], Any], repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _pool(slots: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (slots, LLAMA3_8B.num_kv_heads, LLAMA3_8B.head_dim)
    return [torch.randn(shape, generator=gen).to(LLAMA3_8B.dtype)
            for _ in range(LLAMA3_8B.num_layers)]


def _memcpy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    return nbytes / _best_of(lambda: dst.copy_(src)) / 1e9


def _key_rates(chunk_size: int) -> dict[str, float]:
    kb = KeyBuilder(model="bench", fingerprint=LLAMA3_8B.fingerprint(chunk_size),
                    chunk_size=chunk_size)
    tokens = torch.randint(0, 128_000, (1 << 20,))
    as_list = tokens.tolist()
    return {"keys_tensor_mtok_s": tokens.numel() / _best_of(lambda: kb.keys(tokens), 3) / 1e6,
            "keys_list_mtok_s": tokens.numel() / _best_of(lambda: kb.keys(as_list), 3) / 1e6}


def run_bench(config: Config, *, prompts: int = 8, tokens: int = 2048,
              progress: bool = True) -> dict[str, Any]:
    """Run the benchmark, print a table and return the results as a JSON-ready dict."""
    chunk = config.chunk_size
    tokens = max(chunk, tokens // chunk * chunk)
    slots_total = tokens * 2
    bar = tqdm(total=4 + 2 * prompts, desc="kvtier bench", disable=not progress)
    results: dict[str, Any] = {"config": config.redacted(), "layout": LLAMA3_8B.fingerprint(chunk),
                               "chunk_bytes": LLAMA3_8B.nbytes(chunk),
                               "kernel": ops.kernel_name(),
                               "memcpy_gbps": _memcpy_gbps(LLAMA3_8B.nbytes(chunk))}
    results.update(_key_rates(chunk))
    bar.update(2)
    src = SGLangMHAConnector(_pool(slots_total, 1), _pool(slots_total, 2))
    dst = SGLangMHAConnector(_pool(slots_total, 3), _pool(slots_total, 4))
    gen = torch.Generator().manual_seed(0)
    work = [(torch.randint(0, 128_000, (tokens,), generator=gen),
             torch.randperm(slots_total, generator=gen)[:tokens]) for _ in range(prompts)]
    bar.update()
    engine = CacheEngine(config, model_name="bench", layout=LLAMA3_8B, connector=src)
    try:
        results.update(_connector_rates(engine, src, dst, work[0][1][:chunk]))
        bar.update()
        t0 = time.perf_counter()
        stored = 0
        for toks, slots in work:
            stored += engine.store(toks, slots)
            bar.update()
        results["store_gbps"] = LLAMA3_8B.nbytes(stored) / (time.perf_counter() - t0) / 1e9
        engine.storage.flush()
        reader = CacheEngine(config, model_name="bench", layout=LLAMA3_8B, connector=dst,
                             storage=engine.storage)
        results["tiers"] = _tier_rates(engine, reader, work)
        bar.update(prompts)
        results["stats"] = engine.stats()
    finally:
        engine.close()
        bar.close()
    _print_table(results)
    return results


def _connector_rates(engine: CacheEngine, src: SGLangMHAConnector, dst: SGLangMHAConnector,
                     slots: torch.Tensor) -> dict[str, float]:
    obj = engine.storage.allocator.allocate(LLAMA3_8B, slots.numel())
    if obj is None:
        raise ValueError("max_local_cpu_size is too small for one benchmark chunk")
    try:
        return {"gather_gbps": obj.nbytes / _best_of(lambda: src.gather(slots, obj)) / 1e9,
                "scatter_gbps": obj.nbytes / _best_of(lambda: dst.scatter(obj, slots)) / 1e9}
    finally:
        obj.release()


def _tier_rates(writer: CacheEngine, reader: CacheEngine,
                work: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Retrieve throughput from each tier in turn, emptying the tiers above it first."""
    out = {}
    tiers = writer.storage.tiers
    for i, tier in enumerate(tiers):
        for upper in tiers[:i]:
            for toks, _ in work:
                upper.remove(writer.chunk_keys(toks))
        t0 = time.perf_counter()
        loaded = sum(reader.retrieve(toks, slots) for toks, slots in work)
        seconds = time.perf_counter() - t0
        out[tier.name] = {"retrieve_gbps": LLAMA3_8B.nbytes(loaded) / seconds / 1e9,
                          "tokens_loaded": loaded}
    return out


def _print_table(r: dict[str, Any]) -> None:
    memcpy = r["memcpy_gbps"]
    rows = [("memcpy (baseline)", memcpy), ("gather (connector)", r["gather_gbps"]),
            ("scatter (connector)", r["scatter_gbps"]),
            ("store: keys+gather+cpu put", r["store_gbps"])]
    rows += [(f"retrieve from {name} (+scatter)", t["retrieve_gbps"])
             for name, t in r["tiers"].items()]
    print(f"\nkvtier bench  layout {r['layout']}  chunk {r['chunk_bytes'] / 2**20:.0f} MiB  "
          f"kernel {r['kernel']}")
    print(f"{'path':<34}{'GB/s':>8}{'x memcpy':>10}")
    for name, gbps in rows:
        print(f"{name:<34}{gbps:>8.2f}{gbps / memcpy:>10.2f}")
    print(f"{'store / gather':<34}{r['store_gbps'] / r['gather_gbps']:>8.2f}  "
          "(1.0: the CPU-tier put adds no copy)")
    print(f"{'keys from tensor':<34}{r['keys_tensor_mtok_s']:>8.1f} M tokens/s")
    print(f"{'keys from list':<34}{r['keys_list_mtok_s']:>8.1f} M tokens/s")
