"""Disk tier throughput next to the machine's own raw file I/O, measured in the same run.

For 32 MiB chunks (Llama-3-8B layout, 256 tokens): disk `batch_put` against a raw `os.write` of
the same bytes to fresh files (no fsync), and a cold `batch_get` against a raw cold read of the
same bytes into the same arena in sequential 1 MiB reads (both after dropping the page cache with
posix_fadvise). Raw and tier operations alternate chunk by chunk; the table shows the median
round, and p99 the GB/s of the 99th-percentile chunk (nearest rank over every chunk of every
round). With `--encrypted`, a tier with a record key (records encrypted with AES-256-GCM) runs
too, its rounds interleaved with the plain tier's, and the table adds encrypted / plain. Also
times the index rebuild (tier start-up) over 100,000 small records (warm dentry cache: dropping
it would need root and disturb other users of the machine).

    .venv/bin/python benchmarks/micro/bench_disk.py [--chunks 16] [--rounds 5]
        [--index-records 100000] [--encrypted]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from kvtier.backends import BackendContext
from kvtier.backends.disk import DiskBackend
from kvtier.config import Config
from kvtier.keys import ChunkKey, KeyBuilder
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj

LLAMA3_8B = KVLayout.mha(32, 8, 128, torch.bfloat16)
TINY = KVLayout.mha(1, 1, 16, torch.float16)
TOKENS = 256
RESULTS = Path(__file__).resolve().parents[1] / "results"


def _keys(layout: KVLayout, chunks: int, seed: int, chunk_size: int = TOKENS) -> list[ChunkKey]:
    kb = KeyBuilder(model="bench", fingerprint=layout.fingerprint(chunk_size),
                    chunk_size=chunk_size)
    gen = torch.Generator().manual_seed(seed)
    return kb.keys(torch.randint(0, 128_000, (chunks * chunk_size,), generator=gen))


def _open(root: Path, layout: KVLayout, alloc: MemoryAllocator, cap_gb: float,
          record_key_file: str | None = None) -> DiskBackend:
    config = Config(chunk_size=TOKENS, max_local_cpu_size=alloc.size / 1e9,
                    local_disk=str(root), max_local_disk_size=cap_gb,
                    record_key_file=record_key_file)
    return DiskBackend(BackendContext(config=config, layout=layout, allocator=alloc))


def _drop_cache(paths: list[Path]) -> None:
    os.sync()  # DONTNEED only drops clean pages
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Round:
    """One round: raw and tier writes, then raw and tier cold reads, of the same bytes.

    Raw and tier operations alternate chunk by chunk (and which goes first alternates too), so
    both sides see the same machine state: on a VM, page-cache pages the guest has not touched
    yet are far slower to fill than recycled ones, and other tenants come and go.
    """

    def __init__(self, disk: DiskBackend, src: MemoryObj, dst: MemoryObj, raw_dir: Path):
        self.disk, self.src, self.dst, self.raw_dir = disk, src, dst, raw_dir

    def raw_write(self, i: int) -> None:
        view = self.src.byte_view()
        fd = os.open(self.raw_dir / f"{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        finally:
            os.close(fd)

    def raw_read(self, i: int) -> None:
        """Sequential 1 MiB reads (like `dd bs=1M`); on this VM they beat one 32 MiB read."""
        view = self.dst.byte_view()
        fd = os.open(self.raw_dir / f"{i}.bin", os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                done += os.readv(fd, [view[done : done + (1 << 20)]])
        finally:
            os.close(fd)

    def put(self, key: ChunkKey) -> None:
        assert self.disk.batch_put([key], [self.src]) == 1, self.disk.stats()

    def get(self, key: ChunkKey) -> None:
        got = self.disk.batch_get([key])
        assert len(got) == 1, self.disk.stats()
        got[0].release()

    def run(self, keys: list[ChunkKey]) -> tuple[dict[str, float], dict[str, list[float]]]:
        """GB/s of each operation over the round, and each chunk's seconds."""
        for path in self.raw_dir.iterdir():
            path.unlink()
        os.sync()  # start with no dirty pages
        secs: dict[str, list[float]] = {
            name: [] for name in ("raw_write", "put", "raw_cold_read", "cold_get", "warm_get")}
        for i, key in enumerate(keys):
            pair = [("raw_write", partial(self.raw_write, i)), ("put", partial(self.put, key))]
            for name, fn in pair[:: 1 if i % 2 else -1]:
                secs[name].append(_timed(fn))
        _drop_cache([self.raw_dir / f"{i}.bin" for i in range(len(keys))]
                    + [self.disk.path_for(k.key) for k in keys])
        for i, key in enumerate(keys):
            pair = [("raw_cold_read", partial(self.raw_read, i)),
                    ("cold_get", partial(self.get, key))]
            for name, fn in pair[:: 1 if i % 2 else -1]:
                secs[name].append(_timed(fn))
        for key in keys:
            secs["warm_get"].append(_timed(partial(self.get, key)))
        nbytes = len(keys) * self.src.nbytes
        return {name: nbytes / sum(s) / 1e9 for name, s in secs.items()}, secs


def p99(samples: list[float]) -> float:
    """The 99th percentile, nearest rank (the largest of fewer than 100 samples)."""
    ordered = sorted(samples)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


def _warm_up(workdir: Path, view: memoryview, nbytes: int) -> None:
    """Write and delete `nbytes` of files, so the guest's page-cache frames are backed by the
    host before anything is timed (first-touch faults otherwise dominate the first rounds)."""
    path = workdir / "warm-up"
    for _ in range(max(1, nbytes // len(view))):
        with open(path, "ab") as f:
            f.write(view)
    os.sync()
    path.unlink()


def bench_throughput(workdir: Path, chunks: int, rounds: int,
                     key_files: dict[str, str | None]) -> dict[str, dict[str, object]]:
    """One tier per entry of `key_files` (name: its record key file, or None), their rounds
    interleaved (the order alternating round by round); each name's results."""
    nbytes = LLAMA3_8B.nbytes(TOKENS)
    alloc = MemoryAllocator(3 * nbytes + (1 << 20))  # source, raw target, tier get
    disks = {tag: _open(workdir / f"tier-{tag}", LLAMA3_8B, alloc,
                        cap_gb=2 * chunks * nbytes / 1e9, record_key_file=key_file)
             for tag, key_file in key_files.items()}
    src, dst = alloc.allocate(LLAMA3_8B, TOKENS), alloc.allocate(LLAMA3_8B, TOKENS)
    assert src is not None and dst is not None
    src.tensor.view(torch.uint8).copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
                                       .view(src.tensor.view(torch.uint8).shape))
    per_round: dict[str, list[dict[str, float]]] = {tag: [] for tag in disks}
    per_chunk: dict[str, dict[str, list[float]]] = {tag: {} for tag in disks}
    try:
        _warm_up(workdir, src.byte_view(), 4 * chunks * nbytes)
        benches = {}
        for tag, disk in disks.items():
            (workdir / f"raw-{tag}").mkdir()
            benches[tag] = Round(disk, src, dst, workdir / f"raw-{tag}")
        for r in range(rounds):
            keys = _keys(LLAMA3_8B, chunks, seed=r)
            for tag in list(benches)[:: 1 if r % 2 else -1]:
                speeds, secs = benches[tag].run(keys)
                per_round[tag].append(speeds)
                for name, times in secs.items():
                    per_chunk[tag].setdefault(name, []).extend(times)
                disks[tag].remove(keys)
    finally:
        dst.release()
        src.release()
        for disk in disks.values():
            disk.close()
    out: dict[str, dict[str, object]] = {}
    for tag, rows in per_round.items():
        med = {name: statistics.median(r[name] for r in rows) for name in rows[0]}
        ratios = {
            "put_vs_raw_write": statistics.median(r["put"] / r["raw_write"] for r in rows),
            "cold_get_vs_raw_cold_read": statistics.median(r["cold_get"] / r["raw_cold_read"]
                                                           for r in rows),
        }
        tail = {name: nbytes / p99(times) / 1e9 for name, times in per_chunk[tag].items()}
        out[tag] = {"chunk_bytes": nbytes, "chunks_per_round": chunks, "rounds": rounds,
                    "gb_per_s_median": med, "gb_per_s_p99": tail, "ratio_median": ratios,
                    "per_round": rows}
    return out


def bench_index(workdir: Path, records: int) -> dict[str, float]:
    alloc = MemoryAllocator(1 << 20)
    root = workdir / "index"
    disk = _open(root, TINY, alloc, cap_gb=1.0)
    obj = alloc.allocate(TINY, 16)
    assert obj is not None
    keys = _keys(TINY, records, seed=99, chunk_size=16)
    start = time.perf_counter()
    for i in range(0, records, 64):
        batch = keys[i : i + 64]
        assert disk.batch_put(batch, [obj] * len(batch)) == len(batch)
    fill = time.perf_counter() - start
    obj.release()
    disk.close()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        disk = _open(root, TINY, alloc, cap_gb=1.0)
        times.append(time.perf_counter() - start)
        assert disk.stats()["entries"] == records
        disk.close()
    return {"records": records, "fill_secs": fill, "rebuild_secs_median": statistics.median(times),
            "rebuild_secs_first": times[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16, help="32 MiB chunks per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--index-records", type=int, default=100_000)
    parser.add_argument("--dir", type=Path, default=None, help="scratch dir (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS / "disk.json")
    parser.add_argument("--encrypted", action="store_true",
                        help="also run a tier with a record key (AES-256-GCM records), rounds "
                        "interleaved with the plain tier's, and report encrypted / plain")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir=args.dir))
    key_files: dict[str, str | None] = {"plain": None}
    try:
        if args.encrypted:
            key_file = workdir / "record.key"
            key_file.write_bytes(os.urandom(32).hex().encode())
            key_file.chmod(0o600)
            key_files["encrypted"] = str(key_file)
        results = bench_throughput(workdir, args.chunks, args.rounds, key_files)
        idx = bench_index(workdir, args.index_records) if args.index_records else {}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    thr = results["plain"]
    med, tail, ratio = thr["gb_per_s_median"], thr["gb_per_s_p99"], thr["ratio_median"]
    assert isinstance(med, dict) and isinstance(tail, dict) and isinstance(ratio, dict)
    mib = int(thr["chunk_bytes"]) >> 20  # type: ignore[call-overload]
    print(f"disk tier, {mib} MiB chunks, {args.chunks} chunks x {args.rounds} rounds (median "
          f"round; p99: the 99th-percentile chunk)")
    print(f"{'operation':<12}{'tier GB/s':>11}{'p99':>7}{'raw GB/s':>10}{'p99':>7}{'ratio':>8}"
          f"  baseline")
    for name, raw, baseline in (("put", "raw_write", "raw write, no fsync"),
                                ("cold_get", "raw_cold_read", "raw 1 MiB reads after "
                                 "FADV_DONTNEED"), ("warm_get", None, "(page cache)")):
        if raw is None:
            print(f"{name:<12}{med[name]:>11.2f}{tail[name]:>7.2f}{'':>25}  {baseline}")
        else:
            key = "put_vs_raw_write" if name == "put" else "cold_get_vs_raw_cold_read"
            print(f"{name:<12}{med[name]:>11.2f}{tail[name]:>7.2f}{med[raw]:>10.2f}"
                  f"{tail[raw]:>7.2f}{ratio[key]:>8.2f}  {baseline}")
    enc = results.get("encrypted")
    if enc:
        emed, etail = enc["gb_per_s_median"], enc["gb_per_s_p99"]
        assert isinstance(emed, dict) and isinstance(etail, dict)
        print("encrypted records (record_key_file: AES-256-GCM), tier GB/s and encrypted / "
              "plain in this run:")
        print(f"  {'operation':<10}{'median':>9}{'ratio':>8}{'p99':>8}{'ratio':>8}")
        enc_ratio = {}
        for name in ("put", "cold_get", "warm_get"):
            enc_ratio[name] = {"median": emed[name] / med[name], "p99": etail[name] / tail[name]}
            print(f"  {name:<10}{emed[name]:>9.2f}{enc_ratio[name]['median']:>7.2f}x"
                  f"{etail[name]:>8.2f}{enc_ratio[name]['p99']:>7.2f}x")
        enc["encrypted_vs_plain"] = enc_ratio
    if idx:
        print(f"index rebuild: {idx['records']} records in {idx['rebuild_secs_median']:.2f}s "
              f"(median of 3, warm dentry cache; first {idx['rebuild_secs_first']:.2f}s; "
              f"filling took {idx['fill_secs']:.1f}s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"throughput": thr, "encrypted": enc or {}, "index": idx},
                                   indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
