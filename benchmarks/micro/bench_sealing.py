"""Record sealing throughput with a record key, without a tenant and per tenant (issue 71).

What a tier does to a record besides its I/O: seal it (`seal_for` + `seal_record`: AES-256-GCM
encryption and the checksum, into a ciphertext buffer) and open it (`parse_header` +
`verify_payload`: the checksum, decryption piece by piece, the tag). Cases, rounds interleaved
(the order alternating round by round), the same records and payloads:

- `record key`: chunks without a salt, sealed under the record key itself (today's records);
- `tenant keys`: the same chunks salted, cycling over `--tenants` salts, so each record is
  sealed under its tenant's key (derived from the record key and the salt, kept per process).

Two record sizes: 32 MiB (Llama-3-8B, 256 tokens: where the AES dominates) and 64 KiB (a small
layout: where per-record costs such as key derivation show). Prints the median round's GB/s
(sealed + opened payload bytes over the time) and tenant keys / record key, and writes JSON.

    .venv/bin/python benchmarks/micro/bench_sealing.py [--rounds 7] [--tenants 64]
        [--cases "record key,tenant keys"]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.common import write_results
from kvtier.backends.record import (
    RecordKeys,
    parse_header,
    seal_for,
    seal_record,
    verify_payload,
)
from kvtier.keys import ChunkKey, KeyBuilder
from kvtier.memory import KVLayout, MemoryAllocator, MemoryObj

SIZES = {"32 MiB": (KVLayout.mha(32, 8, 128, torch.bfloat16), 256, 4),
         "64 KiB": (KVLayout.mha(4, 2, 64, torch.bfloat16), 64, 256)}  # layout, tokens, records
CASES = ("record key", "tenant keys")


def _keys(layout: KVLayout, tokens: int, records: int, salts: list[str]) -> list[ChunkKey]:
    """`records` chunk keys, the i-th under salt `salts[i % len(salts)]`."""
    kb = KeyBuilder(model="bench", fingerprint=layout.fingerprint(tokens), chunk_size=tokens)
    ids = torch.arange(records * tokens) % 128_000
    return [kb.keys(ids[i * tokens:(i + 1) * tokens], salts[i % len(salts)])[0]
            for i in range(records)]


def _round(keys: list[ChunkKey], obj: MemoryObj, layout: KVLayout, rk: RecordKeys,
           out: memoryview, back: memoryview) -> float:
    """Seal and open a record of `obj` under each of `keys`; the seconds it took."""
    start = time.perf_counter()
    for key in keys:
        head, stored = seal_record(key, obj, seal_for(key, obj, keys=rk), out)
        parsed = parse_header(head, key, layout)
        back[:] = stored
        verify_payload(parsed, back, keys=rk)
    return time.perf_counter() - start


def run(rounds: int, tenants: int, cases: list[str]) -> dict[str, dict[str, object]]:
    rk = RecordKeys([os.urandom(32).hex().encode()])
    salts = {"record key": [""], "tenant keys": [f"tenant-{i}" for i in range(tenants)]}
    out: dict[str, dict[str, object]] = {}
    for size, (layout, tokens, records) in SIZES.items():
        nbytes = layout.nbytes(tokens)
        alloc = MemoryAllocator(nbytes + (1 << 20))
        obj = alloc.allocate(layout, tokens)
        assert obj is not None
        obj.tensor.view(torch.uint8).copy_(torch.randint(0, 256, obj.tensor.view(
            torch.uint8).shape, dtype=torch.uint8))
        keys = {case: _keys(layout, tokens, records, salts[case]) for case in cases}
        cipher, back = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))
        secs: dict[str, list[float]] = {case: [] for case in cases}
        for case in cases:  # a warm-up round each: buffers faulted in, tenant keys derived
            _round(keys[case], obj, layout, rk, cipher, back)
        for r in range(rounds):
            for case in cases[:: 1 if r % 2 else -1]:
                secs[case].append(_round(keys[case], obj, layout, rk, cipher, back))
        obj.release()
        gbps = {case: 2 * records * nbytes / statistics.median(t) / 1e9 for case, t in
                secs.items()}
        out[size] = {"record_bytes": nbytes, "records_per_round": records, "rounds": rounds,
                     "gb_per_s_median": gbps,
                     "per_round_secs": secs}
        if set(CASES) <= set(cases):
            out[size]["tenant_vs_record_key"] = statistics.median(
                a / b for a, b in zip(secs["record key"], secs["tenant keys"]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--name", default="sealing", help="results file name (no .json)")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        parser.error(f"--cases: unknown {bad}; choose from {list(CASES)}")
    results = run(args.rounds, args.tenants, cases)
    print(f"sealing + opening records with a record key, median of {args.rounds} rounds "
          f"(GB/s of payload sealed and opened)")
    for size, res in results.items():
        gbps = res["gb_per_s_median"]
        assert isinstance(gbps, dict)
        line = "  ".join(f"{case}: {v:.3f}" for case, v in gbps.items())
        ratio = res.get("tenant_vs_record_key")
        tail = f"  tenant keys / record key: {ratio:.3f}x (median of per-round ratios)" \
            if ratio is not None else ""
        print(f"{size:>7} records  {line}{tail}")
    write_results(args.name, results)


if __name__ == "__main__":
    main()
