"""Cold retrieve from the disk tier into a KV pool, next to a raw cold read of the same bytes.

A Llama-3-8B pool (32 layers, 8 KV heads, head_dim 128, bf16) holds one prompt of `--chunks`
256-token chunks (32 MiB each). The prompt is stored through a `CacheEngine` with a CPU + disk
config, the CPU tier is emptied and the page cache of the record files dropped
(posix_fadvise), then:

- `pipelined`: `engine.retrieve` as shipped: the disk tier reads chunks ahead on its read pool
  while the caller scatters the chunks that already arrived;
- `serial`: the same tier read one chunk at a time, each scatter waiting for its read (what
  retrieve did before the read pool);
- `raw`: one thread reading the same record files front to back with `readinto` (1 MiB reads)
  into a buffer, with nothing else: the baseline.

Rounds alternate the three; the table shows medians and ratios to the raw read of the same
round.

    .venv/bin/python benchmarks/micro/bench_retrieve.py [--chunks 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.micro.bench_disk import _drop_cache as drop_page_cache
from kvtier.cli.bench import LLAMA3_8B
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.memory import lease
from kvtier.storage import StorageManager

TOKENS = 256
RESULTS = Path(__file__).resolve().parents[1] / "results"


def _drop_cache(root: Path) -> list[Path]:
    files = sorted(root.rglob("*.kvt"))
    drop_page_cache(files)
    return files


def _raw_read(files: list[Path], buf: memoryview) -> int:
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf[: 1 << 20]):
                total += n
    return total


def _serial_retrieve(engine: CacheEngine, storage: StorageManager, tokens: torch.Tensor,
                     slots: torch.Tensor) -> int:
    disk = next(t for t in storage.tiers if t.name == "disk")
    loaded = 0
    for key in engine.chunk_keys(tokens):
        objs = disk.batch_get([key])
        if not objs:
            break
        with lease(objs):
            engine.connector.scatter(objs[0], slots[key.start:key.end])
        loaded = key.end
    return loaded


def run(chunks: int, rounds: int, workdir: Path) -> dict[str, object]:
    n = chunks * TOKENS
    shape = (n + 1, LLAMA3_8B.num_kv_heads, LLAMA3_8B.head_dim)
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(shape, generator=gen).to(LLAMA3_8B.dtype) for _ in range(32)]
    v = [torch.randn(shape, generator=gen).to(LLAMA3_8B.dtype) for _ in range(32)]
    config = Config(chunk_size=TOKENS, max_local_cpu_size=LLAMA3_8B.nbytes(n) * 1.2 / 1e9,
                    local_disk=str(workdir / "disk"), max_local_disk_size=100.0)
    storage = StorageManager(config, LLAMA3_8B)  # the engine's; the serial baseline reads it
    engine = CacheEngine(config, model_name="bench", layout=LLAMA3_8B,
                         connector=SGLangMHAConnector(k, v), storage=storage)
    tokens = torch.randint(0, 128_000, (n,), generator=gen)
    slots = torch.arange(1, n + 1, dtype=torch.int64)
    try:
        assert engine.store(tokens, slots) == n
        assert engine.flush(600)
        nbytes = LLAMA3_8B.nbytes(n)
        buf = memoryview(bytearray(1 << 20))
        secs: dict[str, list[float]] = {"pipelined": [], "serial": [], "raw": []}
        for _ in range(rounds):
            for name in secs:
                engine.tiers.remove(engine.chunk_keys(tokens), "cpu")
                files = _drop_cache(workdir / "disk")
                start = time.perf_counter()
                if name == "raw":
                    assert _raw_read(files, buf) >= nbytes
                elif name == "serial":
                    assert _serial_retrieve(engine, storage, tokens, slots) == n
                else:
                    assert engine.retrieve(tokens, slots) == n
                secs[name].append(time.perf_counter() - start)
        gbps = {name: nbytes / statistics.median(s) / 1e9 for name, s in secs.items()}
        ratio = {name: statistics.median(r / s for r, s in zip(secs["raw"], secs[name]))
                 for name in ("pipelined", "serial")}
    finally:
        engine.close()
        storage.close()
    return {"chunks": chunks, "chunk_mib": LLAMA3_8B.nbytes(TOKENS) / 2**20, "rounds": rounds,
            "gbps": gbps, "vs_raw_cold_read": ratio, "secs": secs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="a directory on the disk to measure (default: a temp dir)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.workdir))
    try:
        out = run(args.chunks, args.rounds, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    gbps, ratio = out["gbps"], out["vs_raw_cold_read"]
    assert isinstance(gbps, dict) and isinstance(ratio, dict)
    print(f"cold retrieve of {args.chunks} x {out['chunk_mib']:.0f} MiB chunks from the disk "
          f"tier into a Llama-3-8B pool (medians of {args.rounds} rounds)")
    print(f"{'path':<34}{'GB/s':>8}{'x raw':>8}")
    print(f"{'raw cold read (baseline)':<34}{gbps['raw']:>8.2f}{1.0:>8.2f}")
    print(f"{'retrieve, pipelined (shipped)':<34}{gbps['pipelined']:>8.2f}"
          f"{ratio['pipelined']:>8.2f}")
    print(f"{'retrieve, serial (before)':<34}{gbps['serial']:>8.2f}{ratio['serial']:>8.2f}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "bench_retrieve.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
