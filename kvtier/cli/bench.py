"""`kvtier bench`: end-to-end throughput on a Llama-3-8B KV shape, against this machine's memcpy.

Every figure is reported next to a baseline measured in the same run (plain memcpy of the same
bytes), because absolute numbers on shared machines are noise.

The bench runs on a serving host, next to a cache that serves: it must not cost that cache
anything. So it
- stores under a model name of its own per run (`bench-<random>`), a namespace no server reads;
- allocates the arena its working set needs (at most `max_local_cpu_size`), not the full one;
- measures the disk tier in a temporary directory and leaves Redis alone, unless
  `real_tiers` asks for the configured directory and server; their disk tier then never
  evicts (the bench's records are added to what is there), and Redis records expire after an
  hour at most, should the process be killed before it cleans up;
- deletes every record it may have written when it ends, however it ends (error, Ctrl-C).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvtier.backends import BackendContext, create_backend
from kvtier.backends.disk import files as rf
from kvtier.config import Config
from kvtier.config.names import REDIS
from kvtier.config.tiers import lower_tier_names
from kvtier.connectors import SGLangMHAConnector, hugepages
from kvtier.engine import CacheEngine
from kvtier.errors import KVTierError
from kvtier.kernels import ops
from kvtier.keys import ChunkKey, KeyBuilder
from kvtier.memory import ALIGN, KVLayout, MemoryAllocator
from kvtier.storage import StorageManager

__all__ = ["run_bench", "LLAMA3_8B"]

LLAMA3_8B = KVLayout.mha(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
# Arena beyond the stored prompts: the connector probe's chunk and the disk tier's read-ahead.
SLACK_CHUNKS = 8
# The real disk tier's cap during a bench: so large that no write evicts another's record.
NO_EVICTION_GB = 1e6
# Redis records of a bench killed before its clean-up expire after this long at most.
SCRATCH_REDIS_TTL_S = 3600


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
              progress: bool = True, real_tiers: bool = False) -> dict[str, Any]:
    """Run the benchmark, print a table and return the results as a JSON-ready dict.

    Without `real_tiers`, nothing of `config`'s disk directory or Redis server is touched: the
    disk tier is a temporary directory, Redis is not measured. With it, the bench's records go
    to both, under its own model name, and are deleted at the end; other records stay as they
    were (none is evicted for the bench's, though Redis's own `maxmemory` policy may evict).
    """
    chunk = config.chunk_size
    tokens = max(chunk, tokens // chunk * chunk)
    slots_total = tokens * 2
    working = prompts * tokens // chunk * LLAMA3_8B.nbytes(chunk)
    bar = tqdm(total=4 + 2 * prompts, desc="kvtier bench", disable=not progress)
    results: dict[str, Any] = {"config": config.redacted(), "layout": LLAMA3_8B.fingerprint(chunk),
                               "chunk_bytes": LLAMA3_8B.nbytes(chunk),
                               "kernel": ops.kernel_name(),
                               "memcpy_gbps": _memcpy_gbps(LLAMA3_8B.nbytes(chunk))}
    results.update(_key_rates(chunk))
    bar.update(2)
    src = SGLangMHAConnector(_pool(slots_total, 1), _pool(slots_total, 2))
    dst = SGLangMHAConnector(_pool(slots_total, 3), _pool(slots_total, 4))
    if config.huge_pages:  # as a server's CPU pool is (kvtier.connectors.hugepages)
        pages = hugepages.back([*src.pool_layers, *dst.pool_layers], collapse=True)
        results["pool_huge_pages"] = pages.describe()
    gen = torch.Generator().manual_seed(0)
    work = [(torch.randint(0, 128_000, (tokens,), generator=gen),
             torch.randperm(slots_total, generator=gen)[:tokens]) for _ in range(prompts)]
    bar.update()
    try:
        # the writer's and the reader's tiers, closed (writers drained, bounded) before the
        # scratch clean-up runs
        with _scratch(config, working, real_tiers) as (cfg, model, written), \
                contextlib.closing(StorageManager(cfg, LLAMA3_8B)) as storage:
            results["scratch"] = {"model": model, "tiers": list(cfg.tiers),
                                  "real_tiers": real_tiers,
                                  "arena_bytes": int(cfg.max_local_cpu_size * 1e9)}
            engine = CacheEngine(cfg, model_name=model, layout=LLAMA3_8B, connector=src,
                                 storage=storage)
            try:
                # Every key a store may write, known before the first store: clean-up needs no
                # record of what finished.
                written.register([k for toks, _ in work for k in engine.chunk_keys(toks)])
                results.update(_connector_rates(src, dst, work[0][1][:chunk]))
                bar.update()
                t0 = time.perf_counter()
                stored = 0
                for toks, slots in work:
                    stored += engine.store(toks, slots)
                    bar.update()
                results["store_gbps"] = LLAMA3_8B.nbytes(stored) / (time.perf_counter() - t0) / 1e9
                engine.flush()
                reader = CacheEngine(cfg, model_name=model, layout=LLAMA3_8B, connector=dst,
                                     storage=storage)
                results["tiers"] = _tier_rates(engine, reader, work)
                bar.update(prompts)
                results["stats"] = engine.stats()
            finally:
                engine.close()
    finally:
        bar.close()
    _print_table(results)
    return results


@contextlib.contextmanager
def _scratch(config: Config, working: int,
             real_tiers: bool) -> Iterator[tuple[Config, str, _Written]]:
    """The bench's config and model name, and where the caller registers every key it may
    write; on exit (however the block ends) those keys are deleted from the real tiers, or the
    temporary directory is removed."""
    model = f"bench-{secrets.token_hex(6)}"
    arena_gb = min(config.max_local_cpu_size, (working + SLACK_CHUNKS * LLAMA3_8B.nbytes(
        config.chunk_size)) / 1e9)
    changes: dict[str, Any] = {"max_local_cpu_size": arena_gb}
    tmp: str | None = None
    if real_tiers:
        if config.local_disk is not None:
            changes["max_local_disk_size"] = NO_EVICTION_GB
        if config.remote_url is not None:
            changes["remote_ttl_secs"] = min(config.remote_ttl_secs or SCRATCH_REDIS_TTL_S,
                                             SCRATCH_REDIS_TTL_S)
        lower = [t for t in config.tiers if t in lower_tier_names()]
        print(f"kvtier bench: writing {working / 1e9:.2f} GB under model {model} to "
              f"{', '.join(lower) or 'no lower tier'}; deleted "
              f"at the end (if this process is killed first: kvtier purge --model {model})")
    else:
        if config.local_disk is not None:
            tmp = tempfile.mkdtemp(prefix="kvtier-bench-")  # 0700, as the disk tier requires
            changes.update(local_disk=tmp, max_local_disk_size=max(2 * working, 1) / 1e9)
        changes["remote_url"] = None  # no Redis of the bench's own: not measured
    written = _Written(model, config.local_disk_path if real_tiers else None)
    cfg: Config | None = None
    try:
        cfg = dataclasses.replace(config, **changes)
        yield cfg, model, written
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        elif cfg is not None and real_tiers:
            _delete(cfg, written)


class _Written:
    """The keys the bench may write, and which directories of the real disk tier (`root`)
    did not exist before it: the records and those directories are what it deletes."""

    def __init__(self, model: str, root: Path | None):
        self.model = model
        self.keys: list[ChunkKey] = []
        self.root = None if root is None else Path(os.path.abspath(root))
        self.new_dirs: set[Path] = set()
        if self.root is not None and not os.path.lexists(self.root):
            self.new_dirs.add(self.root)

    def register(self, keys: Sequence[ChunkKey]) -> None:
        """Note `keys` before anything is stored under them."""
        self.keys.extend(keys)
        if self.root is None:
            return
        for key in keys:
            name = rf.file_name(key.key)
            for d in (self.root / name[:2], self.root / name[:2] / name[2:4]):
                if not os.path.lexists(d):
                    self.new_dirs.add(d)


def _delete(config: Config, written: _Written) -> None:
    """Delete the bench's records from the disk directory and Redis of `config` (a key never
    written is a no-op), then the directories it created, if empty."""
    keys = written.keys
    if written.root is not None and keys:
        dirs = rf.RecordDirs(written.root)
        failed = 0
        for key in keys:
            name = rf.file_name(key.key)
            if dirs.problem(name) is not None:  # never through a directory that is not private
                failed += 1
                continue
            try:
                os.unlink(rf.record_path(written.root, name))
            except FileNotFoundError:
                pass  # never written (or evicted)
            except OSError:
                failed += 1
        if failed:
            print(f"kvtier bench: could not delete {failed} of its records in {written.root} "
                  f"(kvtier purge --model {written.model} deletes them)", flush=True)
        for d in sorted(written.new_dirs, key=lambda p: -len(p.parts)):  # deepest first
            with contextlib.suppress(OSError):  # not empty: another process wrote there
                os.rmdir(d)
    if config.remote_url is not None and keys:
        ctx = BackendContext(config, LLAMA3_8B, MemoryAllocator(1 << 16, pin=False))
        try:
            redis = create_backend(REDIS, ctx)
        except KVTierError as exc:
            print(f"kvtier bench: cannot delete its Redis records ({exc}); they expire within "
                  f"{SCRATCH_REDIS_TTL_S} s", flush=True)
            return
        try:
            redis.remove(keys)
            if redis.stats().get("down"):
                print(f"kvtier bench: Redis is unreachable: its records of the bench expire "
                      f"within {SCRATCH_REDIS_TTL_S} s", flush=True)
        finally:
            redis.close()


def _connector_rates(src: SGLangMHAConnector, dst: SGLangMHAConnector,
                     slots: torch.Tensor) -> dict[str, float]:
    # An arena of its own, one chunk, allocated as the CPU tier's is (pinned where CUDA is)
    arena = MemoryAllocator(LLAMA3_8B.nbytes(slots.numel()) + ALIGN)
    obj = arena.allocate(LLAMA3_8B, slots.numel())
    assert obj is not None, "an arena sized for one chunk holds it"
    try:
        return {"gather_gbps": obj.nbytes / _best_of(lambda: src.gather(slots, obj)) / 1e9,
                "scatter_gbps": obj.nbytes / _best_of(lambda: dst.scatter(obj, slots)) / 1e9}
    finally:
        obj.release()
        arena.close()


def _tier_rates(writer: CacheEngine, reader: CacheEngine,
                work: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Retrieve throughput from each tier in turn, emptying the tiers above it first."""
    out = {}
    tiers = writer.tiers.names
    for i, tier in enumerate(tiers):
        for upper in tiers[:i]:
            for toks, _ in work:
                writer.tiers.remove(writer.chunk_keys(toks), upper)
        t0 = time.perf_counter()
        loaded = sum(reader.retrieve(toks, slots) for toks, slots in work)
        seconds = time.perf_counter() - t0
        out[tier] = {"retrieve_gbps": LLAMA3_8B.nbytes(loaded) / seconds / 1e9,
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
    scratch = r["scratch"]
    if not scratch["real_tiers"]:
        configured = r["config"]
        notes = (["disk: a temporary directory"] if configured["local_disk"] else []) + (
            ["redis: not measured"] if configured["remote_url"] else [])
        if notes:
            print(f"({'; '.join(notes)}; --real-tiers measures the configured ones)")
