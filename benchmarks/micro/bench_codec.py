"""The lower tiers' codecs (`remote_serde`, issue 72): fp8 (or `--codec int8`) against naive,
in the same run.

Three measurements per layout (a chunk of `--tokens` tokens of KV-like values: normal, a
tenth of the K channels 21x louder, one V token in twenty 6x louder):

- bytes per token a record stores (payload + header) with each codec, and fp8 / naive;
- encode and decode GB/s (of the pool-dtype chunk) as a ratio to a memcpy of the same chunk
  (torch `copy_` between two arena objects) timed in the same rounds, medians: the codec as
  it runs (the C++ kernel once `ops.prepare()` built it, else torch) and its torch path
  (`encode_torch` / `decode_torch`); and the largest relative L2 error of a (K or V, layer)
  slice on these values;
- each tier's writer and load wall time per chunk (`batch_put` / `batch_get` of one chunk:
  what a writer thread and a load do, the encode and decode included), fp8 / naive: the disk
  tier (page cache warm, as right after the write), the Redis tier (a private redis-server
  on a free loopback port, stopped by pid) and `redis-link`: the same server through a
  loopback proxy (harness/delay_proxy.py) that caps both directions at `--link-mbps` (default
  1000: a 1 Gb/s link) with 0.2 ms more per reply. Codecs alternate chunk by chunk and which
  goes first alternates, so both see the same machine state; medians and p99s.

    .venv/bin/python -m benchmarks.micro.bench_codec [--rounds 9] [--chunks 4] [--tokens 256]
        [--layouts smollm2,llama3-8b,llama3-8b-fp32,mla] [--tiers disk,redis,redis-link]
        [--link-mbps 1000] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks.common import write_results
from benchmarks.micro.bench_redis import Server
from harness.delay_proxy import DelayProxy
from kvtier.backends import BackendContext, StorageBackend, create_backend
from kvtier.backends.codec import CODECS, NAIVE, Codec, ScaledCodec
from kvtier.backends.record import expected_header_len
from kvtier.config import Config
from kvtier.kernels import ops
from kvtier.keys import ChunkKey, KeyBuilder
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj

TIERS = ("disk", "redis", "redis-link")
LAYOUTS = {
    "smollm2": KVLayout.mha(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16),
    "llama3-8b": KVLayout.mha(num_layers=32, num_kv_heads=8, head_dim=128,
                              dtype=torch.bfloat16),
    "llama3-8b-fp32": KVLayout.mha(num_layers=32, num_kv_heads=8, head_dim=128,
                                   dtype=torch.float32),
    "mla": KVLayout.mla(num_layers=27, kv_dim=576, dtype=torch.bfloat16),  # DeepSeek-V2-Lite
}


def kv_like(obj: MemoryObj, seed: int) -> None:
    """Fill `obj` with KV-like values (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(obj.tensor.shape, generator=gen)
    x[0] *= 1 + 20 * (torch.rand(x.shape[-1], generator=gen) > 0.9)
    if x.shape[0] == 2:
        x[1] *= 1 + 5 * (torch.rand(x.shape[2], 1, generator=gen) > 0.95)
    obj.tensor.copy_(x)


def _keys(layout: KVLayout, chunks: int, tokens: int, seed: int) -> list[ChunkKey]:
    kb = KeyBuilder(model="bench", fingerprint=layout.fingerprint(tokens), chunk_size=tokens)
    return kb.keys(torch.arange(seed * 7919, seed * 7919 + chunks * tokens) % 128_000)


def _secs(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bytes_per_token(layout: KVLayout, tokens: int) -> dict[str, float]:
    key = _keys(layout, 1, tokens, 0)[0]
    head = expected_header_len(key)
    out = {name: (c.payload_nbytes(layout, tokens) + head) / tokens for name, c in CODECS.items()}
    out["fp8_vs_naive"] = out["fp8"] / out["naive"]
    out["int8_vs_naive"] = out["int8"] / out["naive"]
    return out


def codec_speed(codec: Codec, layout: KVLayout, tokens: int, rounds: int) -> dict[str, float]:
    alloc = MemoryAllocator(3 * layout.nbytes(tokens) + (1 << 20))
    src, dst = alloc.allocate(layout, tokens), alloc.allocate(layout, tokens)
    assert src is not None and dst is not None
    kv_like(src, 1)
    enc = codec.encode(src)
    payload = memoryview(bytearray(enc.byte_view()))
    scratch = memoryview(bytearray(len(payload)))
    assert isinstance(codec, ScaledCodec)
    encode_torch, decode_torch = codec.encode_torch, codec.decode_torch
    fns = {"memcpy": lambda: dst.tensor.copy_(src.tensor), "encode": lambda: codec.encode(src),
           "decode": lambda: codec.decode(payload, dst),
           "torch_encode": lambda: encode_torch(src.tensor, scratch),
           "torch_decode": lambda: decode_torch(payload, dst.tensor)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds + 1):  # interleaved, one of each per round; round 0 warms up
        for name, fn in fns.items():
            took = _secs(fn)
            if r:
                times[name].append(took)
    codec.decode(payload, dst)
    a, b = src.tensor.float().flatten(2), dst.tensor.float().flatten(2)
    err = float(((a - b).norm(dim=2) / a.norm(dim=2)).max())
    nbytes = layout.nbytes(tokens)
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    src.release()
    dst.release()
    out = {f"{name}_gb_s": v for name, v in gbps.items()}
    out |= {f"{name}_vs_memcpy": v / gbps["memcpy"] for name, v in gbps.items() if name != "memcpy"}
    return out | {"max_rel_l2": err}


def _tier(kind: str, serde: str, layout: KVLayout, alloc: MemoryAllocator, where: str,
          tokens: int) -> StorageBackend:
    extra = {"local_disk": where, "max_local_disk_size": 4.0} if kind == "disk" else \
        {"remote_url": where, "remote_timeout_secs": 30.0}
    config = Config(chunk_size=tokens, max_local_cpu_size=alloc.size / 1e9, remote_serde=serde,
                    **extra)  # type: ignore[arg-type]
    return create_backend(kind, BackendContext(config=config, layout=layout, allocator=alloc))


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, -(-int(q * len(ordered)) // 100) - 1)]


def tier_times(codec: Codec, kind: str, layout: KVLayout, tokens: int, chunks: int, rounds: int,
               where: str) -> dict[str, float]:
    """Per-chunk writer (`batch_put`) and load (`batch_get`) seconds of both codecs."""
    alloc = MemoryAllocator(4 * layout.nbytes(tokens) + (8 << 20))
    tiers = {c: _tier("disk" if kind == "disk" else "redis", c, layout, alloc,
                      f"{where}/{c}" if kind == "disk" else where, tokens)
             for c in (NAIVE.name, codec.name)}
    src = alloc.allocate(layout, tokens)
    assert src is not None
    kv_like(src, 2)
    secs: dict[str, list[float]] = {f"{c}_{op}": [] for c in tiers for op in ("put", "get")}
    try:
        for r in range(rounds + 1):  # round 0: warm-up, not counted
            keys = {c: _keys(layout, chunks, tokens, 10 * r + i) for i, c in enumerate(tiers)}
            for i in range(chunks):
                order = list(tiers)[:: 1 if (i + r) % 2 else -1]
                for c in order:
                    t0 = time.perf_counter()
                    assert tiers[c].batch_put([keys[c][i]], [src]) == 1, tiers[c].stats()
                    t1 = time.perf_counter()
                    got = tiers[c].batch_get([keys[c][i]])
                    t2 = time.perf_counter()
                    assert len(got) == 1, tiers[c].stats()
                    got[0].release()
                    if r:
                        secs[f"{c}_put"].append(t1 - t0)
                        secs[f"{c}_get"].append(t2 - t1)
            for c in tiers:
                tiers[c].remove(keys[c])
    finally:
        src.release()
        for tier in tiers.values():
            tier.close()
    out = {f"{n}_ms_median": statistics.median(s) * 1e3 for n, s in secs.items()}
    out |= {f"{n}_ms_p99": _p(s, 99) * 1e3 for n, s in secs.items()}
    for op in ("put", "get"):
        out[f"{op}_vs_naive"] = out[f"{codec.name}_{op}_ms_median"] / out[f"naive_{op}_ms_median"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--tiers", default="disk,redis,redis-link")
    parser.add_argument("--link-mbps", type=float, default=1000.0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--codec", choices=[c for c in CODECS if c != NAIVE.name],
                        default="fp8")
    parser.add_argument("--name", default="codec", help="results file name (no .json)")
    args = parser.parse_args(argv)
    layouts = [n.strip() for n in args.layouts.split(",") if n.strip()]
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if bad := [n for n in layouts if n not in LAYOUTS] + [t for t in tiers
                                                         if t not in TIERS]:
        parser.error(f"unknown layouts/tiers {bad}; layouts: {list(LAYOUTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    codec = CODECS[args.codec]
    kernel = ops.prepare()  # "cpp": the codec runs in the C++ kernel; "torch": in torch
    print(f"codec {codec.name} in {'the C++ kernel' if kernel != 'torch' else 'torch'}; torch "
          f"threads {torch.get_num_threads()}")
    results: dict[str, object] = {"torch_threads": torch.get_num_threads(), "codec": codec.name,
                                  "kernel": kernel, "layouts": {}}
    results["link_mbps"] = args.link_mbps
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-codec-") as tmp:
        server = Server(tmp) if {"redis", "redis-link"} & set(tiers) else None
        rate = args.link_mbps * 1e6 / 8
        proxy = DelayProxy(server.port, 0.0002, rate, upload_bytes_per_s=rate) \
            if server is not None and "redis-link" in tiers else None
        try:
            for name in layouts:
                layout = LAYOUTS[name]
                res: dict[str, object] = {
                    "chunk_bytes": layout.nbytes(args.tokens),
                    "bytes_per_token": bytes_per_token(layout, args.tokens),
                    "codec": codec_speed(codec, layout, args.tokens, args.rounds)}
                for tier in tiers:
                    where = {"disk": f"{tmp}/disk-{name}",
                             "redis": f"redis://127.0.0.1:{server and server.port}",
                             "redis-link": proxy.url if proxy else ""}[tier]
                    res[tier] = tier_times(codec, tier, layout, args.tokens, args.chunks,
                                           args.rounds, where)
                results["layouts"][name] = res  # type: ignore[index]
                _print(name, res, tiers, codec.name)
        finally:
            if proxy is not None:
                proxy.close()
            if server is not None:
                server.stop()
    write_results(args.name, results)


def _print(name: str, res: dict[str, object], tiers: list[str], c: str) -> None:
    bpt, speed = res["bytes_per_token"], res["codec"]
    assert isinstance(bpt, dict) and isinstance(speed, dict)
    print(f"{name} ({res['chunk_bytes']} B/chunk): bytes/token naive {bpt['naive']:.0f}, {c} "
          f"{bpt[c]:.0f} ({bpt[c + '_vs_naive']:.3f}x); memcpy {speed['memcpy_gb_s']:.2f} "
          f"GB/s, encode {speed['encode_gb_s']:.2f} ({speed['encode_vs_memcpy']:.3f}x), decode "
          f"{speed['decode_gb_s']:.2f} ({speed['decode_vs_memcpy']:.3f}x) [torch path: encode "
          f"{speed['torch_encode_gb_s']:.2f} ({speed['torch_encode_vs_memcpy']:.3f}x), decode "
          f"{speed['torch_decode_gb_s']:.2f} ({speed['torch_decode_vs_memcpy']:.3f}x)]; max rel "
          f"L2 {speed['max_rel_l2']:.4f}")
    for tier in tiers:
        t = res[tier]
        assert isinstance(t, dict)
        print(f"  {tier:10} per chunk ms, median (p99): put naive {t['naive_put_ms_median']:.2f} "
              f"({t['naive_put_ms_p99']:.2f}) {c} {t[c + '_put_ms_median']:.2f} "
              f"({t[c + '_put_ms_p99']:.2f}) = {t['put_vs_naive']:.2f}x;  get naive "
              f"{t['naive_get_ms_median']:.2f} ({t['naive_get_ms_p99']:.2f}) {c} "
              f"{t[c + '_get_ms_median']:.2f} ({t[c + '_get_ms_p99']:.2f}) = "
              f"{t['get_vs_naive']:.2f}x")


if __name__ == "__main__":
    main()
