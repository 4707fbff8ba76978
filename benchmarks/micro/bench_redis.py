"""Redis tier put/get throughput against plain redis-py and a minimal raw-socket client.

Starts its own redis-server on a free loopback port (persistence off, stopped by pid). Chunks
use a Llama-3-8B-like per-rank layout (32 layers, 8 KV heads x 128, bf16 = 128 KiB per token):
16 tokens = 2 MiB, 32 tokens = 4 MiB, 256 tokens = 32 MiB. Every call moves one batch of
`--batch` chunks of the same size; GB/s is 1e9 bytes per second.

Rows per size:
- `kvtier`: RedisBackend.batch_put / batch_get (pipelined, records checksummed and verified,
  payload in segments of `--segment-mb`);
- `kvtier encrypted`: the same with a record key (`record_key_file`): every record encrypted
  with AES-256-GCM on put (into a buffer of its own) and decrypted in place in the arena on get;
- `kvtier segments N MiB` / `kvtier unsegmented`: the same with other segment sizes or one
  value per chunk (the ablation of segmenting; `--segment-sweep`);
- `kvtier MGET reads`: the `kvtier` row with `atomic_reads=True`: one MGET per chunk instead
  of one GET per segment (the ablation of split reads; only on segmented chunks);
- `redis-py`: SET/GET of `bytes` with hiredis (the default install);
- `redis-py python packer`: redis-py with PythonRespSerializer and the hiredis parser;
- `raw socket`: the minimal client: a hand-packed SET followed by `sendall(memoryview)`, and a
  GET read with `recv_into` into one preallocated buffer per chunk; no verification;
- `raw MSET segments` / `raw MULTI segments` (put only): each value split into
  `--segment-mb` pieces under one hash tag and written atomically with one MSET, or with
  MULTI/SET.../EXEC as kvtier does (MULTI also allows a TTL per key).

The implementations are timed in interleaved rounds (one call of each per round), so machine
noise hits them alike; each figure is the median over `--iters` rounds, and `p99` the GB/s of
the 99th-percentile call (nearest rank: under 100 rounds, the slowest call). Ratios are against
the raw client on the same size and against the raw client on 4 MiB values (the issue's
target); the summary gives encrypted / plain `kvtier`, medians and p99s.

    .venv/bin/python benchmarks/micro/bench_redis.py [--iters 9] [--batch 4] [--sizes 2,4,32]
        [--segment-mb MiB] [--segment-sweep 0.5,1,2,4,8,512]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch
from redis._parsers import Encoder
from redis.connection import PythonRespSerializer

from kvtier.backends import BackendContext
from kvtier.backends.redis import RedisBackend
from kvtier.backends.redis import io as rio
from kvtier.config import Config
from kvtier.keys import KeyBuilder
from kvtier.memory import KVLayout, MemoryAllocator

RESULTS = Path(__file__).resolve().parents[1] / "results" / "redis.json"
LAYOUT = KVLayout.mha(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)

Case = tuple[Callable[[], object], Callable[[], object]]  # (put, get) of one batch


class Server:
    """A private redis-server on a free port, stopped by pid."""

    def __init__(self, workdir: str):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found on PATH (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.wait()


class RawClient:
    """The minimal client (see the module docstring)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def set(self, key: bytes, value: memoryview) -> None:
        self.sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key,
                                                                      len(value)))
        self.sock.sendall(value)
        self.sock.sendall(b"\r\n")
        if self.sock.recv(16) != b"+OK\r\n":
            raise RuntimeError("SET failed")

    def get(self, key: bytes, out: memoryview) -> None:
        self.sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key))
        head = memoryview(bytearray(len(b"$%d\r\n" % len(out))))
        for view in (head, out):
            got = 0
            while got < len(view):
                got += self.sock.recv_into(view[got:])
        self.sock.recv(2, socket.MSG_WAITALL)


def kvtier_case(port: int, tokens: int, batch: int, segment_mb: float,
                cleanup: list[Callable[[], None]], atomic_reads: bool = False,
                record_key_file: str | None = None) -> Case:
    nbytes = LAYOUT.nbytes(tokens)
    alloc = MemoryAllocator(nbytes * batch * 2 + (16 << 20))
    cfg = Config(chunk_size=tokens, max_local_cpu_size=alloc.size / 1e9,
                 remote_url=f"redis://127.0.0.1:{port}", remote_segment_mb=segment_mb,
                 record_key_file=record_key_file)
    backend = RedisBackend(BackendContext(cfg, LAYOUT, alloc), atomic_reads=atomic_reads)
    kb = KeyBuilder(model=f"bench-s{segment_mb}{'-enc' if record_key_file else ''}",
                    fingerprint=LAYOUT.fingerprint(tokens), chunk_size=tokens)
    keys = kb.keys(torch.randint(0, 50_000, (tokens * batch,)))
    objs = []
    for _ in keys:
        obj = alloc.allocate(LAYOUT, tokens)
        assert obj is not None
        obj.tensor.view(-1).view(torch.uint8).copy_(
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        objs.append(obj)

    def put() -> None:
        assert backend.batch_put(keys, objs) == len(keys), backend.stats()

    def get() -> None:
        got = backend.batch_get(keys)
        assert len(got) == len(keys), backend.stats()
        for obj in got:
            obj.release()

    def close() -> None:
        for obj in objs:
            obj.release()
        backend.close()

    cleanup.append(close)
    return put, get


def redispy_case(client: redis.Redis, values: list[bytes], tag: bytes,
                 cleanup: list[Callable[[], None]]) -> Case:
    keys = [b"%s-%d" % (tag, i) for i in range(len(values))]
    cleanup.append(client.close)

    def put() -> None:
        for k, v in zip(keys, values):
            client.set(k, v)

    def get() -> None:
        for k in keys:
            assert client.get(k) is not None

    return put, get


def raw_case(port: int, values: list[bytes], cleanup: list[Callable[[], None]]) -> Case:
    raw = RawClient(port)
    cleanup.append(raw.sock.close)
    views = [memoryview(v) for v in values]
    outs = [memoryview(bytearray(len(v))) for v in values]
    keys = [b"raw-%d" % i for i in range(len(values))]

    def put() -> None:
        for k, v in zip(keys, views):
            raw.set(k, v)

    def get() -> None:
        for k, out in zip(keys, outs):
            raw.get(k, out)

    return put, get


def segmented_case(port: int, values: list[bytes], seg_mb: float, how: str,
                   cleanup: list[Callable[[], None]]) -> Case:
    """Raw-socket writes of values split into segments under one hash tag, with one MSET or
    one MULTI/SET.../EXEC per value (the atomic-write ablation; kvtier uses MULTI)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    cleanup.append(sock.close)
    reader = rio.ReplyReader(sock)
    seg = int(seg_mb * (1 << 20))
    views = [memoryview(v) for v in values]
    names = [[f"{{{how}-{i}}}#{j}" for j in range(len(rio.segments(len(v), seg)))]
             for i, v in enumerate(values)]

    def put() -> None:
        for view, keys in zip(views, names):
            out = rio.CommandWriter()
            pieces = rio.segments(len(view), seg)
            if how == "mset":
                out.command("MSET", *[x for k, (a, b) in zip(keys, pieces)
                                      for x in (k, view[a:b])])
            else:
                out.command("MULTI")
                for k, (a, b) in zip(keys, pieces):
                    out.command("SET", k, view[a:b])
                out.command("EXEC")
            for part in out.finish():
                sock.sendall(part)
            for _ in range(1 if how == "mset" else len(keys) + 2):
                reader.reply()

    return put, lambda: None


def p99(samples: list[float]) -> float:
    """The 99th percentile, nearest rank (the largest of fewer than 100 samples)."""
    ordered = sorted(samples)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


Speeds = dict[str, tuple[float, float, float, float]]  # impl: put, get GB/s (median, p99)


def measure_size(port: int, mib: int, args: argparse.Namespace) -> Speeds:
    tokens = (mib << 20) // LAYOUT.nbytes(1)
    values = [os.urandom(mib << 20) for _ in range(args.batch)]
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    cleanup: list[Callable[[], None]] = []
    cases = {"kvtier": kvtier_case(port, tokens, args.batch, args.segment_mb, cleanup),
             # encrypted records (record_key_file): the cost of AES-256-GCM
             "kvtier encrypted": kvtier_case(port, tokens, args.batch, args.segment_mb,
                                             cleanup, record_key_file=args.key_file)}
    if mib > args.segment_mb:
        cases["kvtier MGET reads"] = kvtier_case(port, tokens, args.batch, args.segment_mb,
                                                 cleanup, atomic_reads=True)
    for seg in args.segment_sweep:  # ablations: other segment sizes, 512 = unsegmented
        name = "kvtier unsegmented" if seg >= mib else f"kvtier segments {seg:g} MiB"
        if seg != args.segment_mb and mib > args.segment_mb and name not in cases:
            cases[name] = kvtier_case(port, tokens, args.batch, seg, cleanup)
    cases["redis-py"] = redispy_case(redis.Redis(port=port, protocol=2), values, b"py", cleanup)
    cases["redis-py python packer"] = redispy_case(
        redis.Redis(connection_pool=redis.ConnectionPool(port=port, protocol=2,
                                                         command_packer=packer)),
        values, b"pypack", cleanup)
    cases["raw socket"] = raw_case(port, values, cleanup)
    if mib > args.segment_mb:
        for how in ("mset", "multi"):
            cases[f"raw {how.upper()} segments"] = segmented_case(port, values, args.segment_mb,
                                                                  how, cleanup)
    times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in cases}
    try:
        for rnd in range(args.iters + 1):  # round 0 warms up (and stores what GET reads)
            for name, fns in cases.items():
                for op, fn in enumerate(fns):
                    start = time.perf_counter()
                    fn()
                    if rnd:
                        times[name][op].append(time.perf_counter() - start)
    finally:
        for close in cleanup:
            close()
    total = args.batch * (mib << 20)
    return {n: (total / statistics.median(p) / 1e9, total / statistics.median(g) / 1e9,
                total / p99(p) / 1e9, total / p99(g) / 1e9)
            for n, (p, g) in times.items()}


def run(args: argparse.Namespace) -> dict[str, object]:
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as workdir:
        args.key_file = os.path.join(workdir, "record.key")
        with open(args.key_file, "w") as f:
            f.write(os.urandom(32).hex())
        os.chmod(args.key_file, 0o600)
        server = Server(workdir)
        try:
            results = {mib: measure_size(server.port, mib, args) for mib in args.sizes}
        finally:
            server.stop()
    raw4 = results[4]["raw socket"] if 4 in results else None
    for mib, by_impl in results.items():
        raw = by_impl["raw socket"]
        for impl, (put, get, put99, get99) in by_impl.items():
            put_only = impl.startswith("raw") and impl.endswith("segments")
            row: dict[str, object] = {
                "size_mib": mib, "impl": impl, "put_gbps": put, "put_vs_raw": put / raw[0],
                "get_gbps": None if put_only else get,
                "get_vs_raw": None if put_only else get / raw[1],
                "put_gbps_p99": put99, "get_gbps_p99": None if put_only else get99}
            if raw4 is not None:
                row["put_vs_raw_4mib"] = put / raw4[0]
                row["get_vs_raw_4mib"] = None if put_only else get / raw4[1]
            rows.append(row)
    return {"machine": platform.node(), "cpus": os.cpu_count(), "batch": args.batch,
            "iters": args.iters, "segment_mb": args.segment_mb, "redis_py": redis.__version__,
            "load_avg_1m": os.getloadavg()[0], "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--batch", type=int, default=4, help="chunks per call")
    parser.add_argument("--sizes", default="2,4,32", help="chunk sizes in MiB")
    parser.add_argument("--segment-mb", type=float, default=Config().remote_segment_mb,
                        help="the segment size of the `kvtier` rows (default: the config's)")
    parser.add_argument("--segment-sweep", default="0.5,1,2,4,8,512",
                        help="other segment sizes (MiB) to time on chunks above --segment-mb")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.segment_sweep = [float(s) for s in args.segment_sweep.split(",") if s]
    result = run(args)
    print(f"{'size':>6} {'impl':<24} {'put GB/s':>9} {'get GB/s':>9} {'put p99':>8} "
          f"{'get p99':>8} {'put/raw':>8} {'get/raw':>8} {'put/raw4':>9} {'get/raw4':>9}")
    def cell(value: object, width: int) -> str:
        return f"{value:{width}.2f}" if isinstance(value, float) else f"{'-':>{width}}"

    for r in result["rows"]:  # type: ignore[attr-defined]
        print(f"{r['size_mib']:>4}Mi {r['impl']:<24} {cell(r['put_gbps'], 9)} "
              f"{cell(r['get_gbps'], 9)} {cell(r['put_gbps_p99'], 8)} "
              f"{cell(r['get_gbps_p99'], 8)} {cell(r['put_vs_raw'], 8)} "
              f"{cell(r['get_vs_raw'], 8)} {cell(r.get('put_vs_raw_4mib'), 9)} "
              f"{cell(r.get('get_vs_raw_4mib'), 9)}")
    by = {(r["size_mib"], r["impl"]): r for r in result["rows"]}  # type: ignore[attr-defined]
    for mib in args.sizes:
        plain, enc = by[(mib, "kvtier")], by[(mib, "kvtier encrypted")]
        ratio = {f: enc[f] / plain[f]  # type: ignore[operator]
                 for f in ("put_gbps", "get_gbps", "put_gbps_p99", "get_gbps_p99")}
        result.setdefault("encrypted_vs_plain", {})[mib] = ratio  # type: ignore[union-attr]
        print(f"encrypted / plain records, {mib} MiB chunks (GB/s ratio): put median "
              f"{ratio['put_gbps']:.2f}x p99 {ratio['put_gbps_p99']:.2f}x, get median "
              f"{ratio['get_gbps']:.2f}x p99 {ratio['get_gbps_p99']:.2f}x")
    print(f"load average during the run: {result['load_avg_1m']:.1f} on {result['cpus']} cpus")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
