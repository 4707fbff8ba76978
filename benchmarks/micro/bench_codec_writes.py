"""Disk writers and loads of codec records against naive on the page cache (issue 72's "not
slower in wall time per chunk than naive at the same tier"), an in-process A/B.

Two disk tiers, `naive` and the codec (`--codec`, default fp8), on the page cache: each round
puts one chunk into each (`batch_put`, what a writer thread does) and loads it back
(`batch_get`), the order alternating round by round, so both see the same machine state.
`--reads device` loads each record from the disk itself: before its get, the record is synced
and dropped from the page cache (`posix_fadvise(DONTNEED)`, untimed), as a record read long
after it was written would be (its puts, which follow the last round's sync, are kept in the
JSON but not printed); `page_cache` (default) loads it from the page cache.

Per codec and op: wall ms per chunk (median, p25, p99) and process CPU ms per chunk (median),
and the codec's over naive's at each quantile. `--busy N` runs the rounds beside a process
doing N-thread float32 matmuls (a busy host), stopped by pid; 0 beside nothing of ours;
`--busy 0,2` (default) both, one after the other.

    .venv/bin/python -m benchmarks.micro.bench_codec_writes [--rounds 200] [--layout smollm2]
        [--codec fp8] [--busy 0,2] [--reads page_cache,device] [--tokens 256]
        [--name codec_writes]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import write_results
from benchmarks.micro.bench_codec import LAYOUTS, _keys, _p, _tier, kv_like
from kvtier.backends import StorageBackend
from kvtier.backends.codec import CODECS, NAIVE
from kvtier.backends.disk.files import file_name, record_path
from kvtier.kernels import ops
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryAllocator, MemoryObj

_BUSY = """
import torch, sys
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(768, 768)
while True:
    a = torch.tanh(a @ a)
"""


def _evict(tier: StorageBackend, key: ChunkKey) -> None:
    """Write `key`'s record to the disk and drop it from the page cache (its next read comes
    from the device)."""
    fd = os.open(record_path(tier.root, file_name(key.key)), os.O_RDONLY)  # type: ignore[attr-defined]
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _run(tier: StorageBackend, keys: list[ChunkKey], src: MemoryObj,
         device: bool) -> tuple[float, ...]:
    """One put then one get (from the device when `device`): (put wall, put CPU, get wall,
    get CPU) seconds."""
    c0, t0 = time.process_time(), time.perf_counter()
    assert tier.batch_put(keys, [src]) == 1, tier.stats()
    c1, t1 = time.process_time(), time.perf_counter()
    if device:
        _evict(tier, keys[0])
        c1, t1 = time.process_time(), time.perf_counter()
    got = tier.batch_get(keys)
    c2, t2 = time.process_time(), time.perf_counter()
    assert len(got) == 1, tier.stats()
    got[0].release()
    return t1 - t0, c1 - c0, t2 - t1, c2 - c1


def measure(layout_name: str, codec: str, tokens: int, rounds: int, where: str,
            device: bool = False) -> dict[str, float]:
    layout = LAYOUTS[layout_name]
    alloc = MemoryAllocator(4 * layout.nbytes(tokens) + (8 << 20))
    arms = [NAIVE.name, codec]
    tiers = {arm: _tier("disk", arm, layout, alloc, f"{where}/{arm}", tokens) for arm in arms}
    src = alloc.allocate(layout, tokens)
    assert src is not None
    kv_like(src, 2)
    samples: dict[str, list[float]] = {f"{a}_{m}": [] for a in arms
                                       for m in ("put", "put_cpu", "get", "get_cpu")}
    try:
        for r in range(rounds + 1):  # round 0 warms up (the directories, the scratch)
            for i, arm in enumerate(arms[:: 1 if r % 2 else -1]):
                keys = _keys(layout, 1, tokens, 2 * r + i)
                got = _run(tiers[arm], keys, src, device)
                tiers[arm].remove(keys)
                if r:
                    for m, v in zip(("put", "put_cpu", "get", "get_cpu"), got, strict=True):
                        samples[f"{arm}_{m}"].append(v)
    finally:
        src.release()
        for tier in tiers.values():
            tier.close()
    out: dict[str, float] = {}
    for name, s in samples.items():
        out[f"{name}_ms_median"] = statistics.median(s) * 1e3
        if not name.endswith("_cpu"):
            out[f"{name}_ms_p25"] = _p(s, 25) * 1e3
            out[f"{name}_ms_p99"] = _p(s, 99) * 1e3
    for arm in arms[1:]:
        for op in ("put", "get"):
            for q in ("median", "p25", "p99"):
                out[f"{arm}_{op}_{q}_vs_naive"] = (out[f"{arm}_{op}_ms_{q}"]
                                                   / out[f"naive_{op}_ms_{q}"])
    return out


def _print(label: str, res: dict[str, float], codec: str, puts: bool) -> None:
    """The run's table; `puts` false for reads from the device, whose puts follow the last
    round's sync (the journal's commits), not a writer's usual state."""
    print(label)
    for op in ("put", "get") if puts else ("get",):
        for arm in (NAIVE.name, codec):
            line = (f"  {op} {arm:12} wall ms median {res[f'{arm}_{op}_ms_median']:.3f} p25 "
                    f"{res[f'{arm}_{op}_ms_p25']:.3f} p99 {res[f'{arm}_{op}_ms_p99']:.3f}; "
                    f"CPU ms median {res[f'{arm}_{op}_cpu_ms_median']:.3f}")
            if arm != NAIVE.name:
                line += (f"; vs naive median {res[f'{arm}_{op}_median_vs_naive']:.3f}x, p25 "
                         f"{res[f'{arm}_{op}_p25_vs_naive']:.3f}x, p99 "
                         f"{res[f'{arm}_{op}_p99_vs_naive']:.3f}x")
            print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="smollm2")
    parser.add_argument("--codec", choices=[c for c in CODECS if c != NAIVE.name],
                        default="fp8")
    parser.add_argument("--busy", default="0,2",
                        help="threads of a matmul process beside each run (0: none)")
    parser.add_argument("--reads", default="page_cache",
                        help="where loads read records: page_cache, device (dropped from the "
                             "page cache first), or both (page_cache,device)")
    parser.add_argument("--name", default="codec_writes", help="results file (no .json)")
    args = parser.parse_args(argv)
    reads = args.reads.split(",")
    if not reads or set(reads) - {"page_cache", "device"}:
        parser.error(f"--reads must name page_cache and/or device, got {args.reads!r}")
    kernel = ops.prepare()
    results: dict[str, object] = {"kernel": kernel, "codec": args.codec, "layout": args.layout,
                                  "rounds": args.rounds, "runs": {}}
    print(f"codec {args.codec} ({kernel}), layout {args.layout}, {args.rounds} rounds")
    for busy, where in ((int(b), r) for b in args.busy.split(",") for r in reads):
        proc = subprocess.Popen([sys.executable, "-c", _BUSY, str(busy)]) if busy else None
        try:
            if proc is not None:
                time.sleep(1.0)  # its threads running
            load0 = os.getloadavg()[0]
            with tempfile.TemporaryDirectory(prefix="kvtier-bench-writes-") as tmp:
                res = measure(args.layout, args.codec, args.tokens, args.rounds, tmp,
                              device=where == "device")
            res["load_before"], res["load_after"] = load0, os.getloadavg()[0]
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
        label = f"busy{busy}" + ("" if where == "page_cache" else f"_{where}")
        results["runs"][label] = res  # type: ignore[index]
        _print(f"busy {busy}, reads from the {where} (load {res['load_before']:.1f} -> "
               f"{res['load_after']:.1f})", res, args.codec, where == "page_cache")
    write_results(args.name, results)


if __name__ == "__main__":
    main()
