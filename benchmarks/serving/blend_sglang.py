"""bench_blend's `--engine sglang`: the same retrieval workload served by a real SGLang server
with `enable_blending` (the README's CPU line, SmolLM2 in float32).

Warm-up: each pool document is sent once alone (blending on), so the server computes it as a
missed segment and stores it in the background; the run waits until all are stored. Then per
query, after `/flush_cache` (SGLang's device tree starts empty; kvtier's tiers keep their
segments), two ways to the first answer token:
    full     the request opts out (`custom_params: {"kvtier_blend": false}`) under its own
             `cache_salt`: every token computed by SGLang
    blend    the same prompt with blending on
TTFT is the wall time of a request for one output token. Quality: the answer of
`--answer-tokens` greedy tokens served right after (it reuses the prompt's KV the TTFT request
left on the device, blended or full), and the KL of the next-token distribution (top 20, over
the ids both list) averaged over the first `--kl-tokens` answer positions, as far as the two
answers are the same (`answer_kl`; `kl_first`: the first position's alone). No naive arm here:
the offline engine measures it.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from benchmarks.serving.adaptive_report import p99
from kvtier.demo.quality import TOP_K, Answer, compare, top_kl
from kvtier.demo.server import CPU_FLAGS, SGLangServer, cpu_shims_dir

__all__ = ["BLENDED", "answer_kl", "generate", "run_sglang", "server_for"]

BLENDED = re.compile(r"kvtier: blended \S+: (\d+) tokens from (\d+) segments .*?, (\d+) of "
                     r"them recomputed")


def server_for(model: Path, work: Path, args: argparse.Namespace, separator: str, *,
               name: str = "blend", blending: bool = True) -> SGLangServer:
    """A server of the README's CPU line with kvtier (`blending`: `enable_blending`); its
    config and log are `name`.yaml and `name`-server.log in `work`."""
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "chunk_size": 256, "max_local_cpu_size": 2.0, "enable_blending": blending,
        "blend_special_str": separator, "blend_recompute_ratios": args.ratios,
        "blend_check_layers": args.check_layers, "blend_min_tokens": 64,
        "blend_max_prefill_ratio": getattr(args, "max_prefill_ratio", 1.0)}))
    flags = ["--enable-kvtier", "--kvtier-config-file", str(config), "--max-total-tokens",
             "16384", "--enable-metrics"]
    if getattr(args, "tp", 1) > 1:  # every rank blends in step (blend_ranks.py)
        flags += ["--tp", str(args.tp)]
    return SGLangServer(model, work / f"{name}-server.log", args=flags,
                        pythonpath=[cpu_shims_dir()], cpu_flags=CPU_FLAGS)


def generate(server: SGLangServer, ids: list[int], tokens: int, *, full: bool,
              salt: str | None) -> tuple[dict[str, Any], float]:
    params: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": tokens}
    if full:
        params["custom_params"] = {"kvtier_blend": False}
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": params,
                            "return_logprob": True, "top_logprobs_num": TOP_K}
    if salt is not None:
        body["cache_salt"] = salt
    start = time.perf_counter()
    out = server.post("/generate", body)
    return out, time.perf_counter() - start


def _stored(server: SGLangServer) -> float:
    """Segments the server has computed alone and stored (its `/metrics`)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == "kvtier_sglang_blend_segments_stored_total")


def answer_kl(full: Answer, blend: Answer, full_tops: list[Any], blend_tops: list[Any],
              n: int) -> float:
    """KL(full || blend) of the next-token distribution (top-K lists) averaged over the first
    `n` answer positions, but only as far as both answers are the same so far: past the first
    token where they part, the two condition on different text. The position where they part
    counts (its distributions still follow the same text)."""
    same = next((i for i, (a, b) in enumerate(zip(full.ids, blend.ids)) if a != b),
                min(len(full.ids), len(blend.ids)) - 1)
    kls = [top_kl({int(t[1]): float(t[0]) for t in f}, {int(t[1]): float(t[0]) for t in b})
           for f, b in list(zip(full_tops, blend_tops))[:min(n, same + 1)]]
    return statistics.fmean(kls)


def _warm(server: SGLangServer, docs: list[list[int]], sep: list[int], system: list[int],
          ask: list[int], ranks: int = 1) -> None:
    for doc in docs:
        generate(server, system + sep + doc + sep + ask, 1, full=False, salt=None)
    deadline = time.monotonic() + 60 * len(docs)
    want = len(docs) * ranks  # each TP rank stores its columns of each
    while _stored(server) < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {_stored(server):.0f} of {want} documents stored; "
                               f"see {server.log_path}")
        time.sleep(1.0)


def _fallbacks(server: SGLangServer) -> int:
    """Requests the server computed because a blend would have lost (blending's planner)."""
    return server.log().count("computed, not blended: a blend of")


def run_sglang(args: argparse.Namespace, model: Path, docs: list[list[int]],
               queries: list[list[int]], sep: list[int], system: list[int], ask: list[int],
               work: Path, separator: str) -> dict[str, Any]:
    """The sglang engine's summary (bench_blend's JSON keys; no naive arm)."""
    server = server_for(model, work, args, separator)
    server.start()
    rows = []
    try:
        _warm(server, docs, sep, system, ask, getattr(args, "tp", 1))
        for q, ids in enumerate(queries):
            row: dict[str, Any] = {"tokens": len(ids)}
            blends = len(BLENDED.findall(server.log()))
            for arm in ("full", "blend"):
                server.flush_cache()
                salt = f"full-{q}" if arm == "full" else None
                fallbacks = _fallbacks(server)
                _, row[f"{arm}_s"] = generate(server, ids, 1, full=arm == "full", salt=salt)
                row["fallback"] = _fallbacks(server) > fallbacks  # the timed request's choice
                out, _ = generate(server, ids, args.answer_tokens, full=arm == "full",
                                   salt=salt)
                row[arm] = Answer.from_response(out)
                row[f"{arm}_tops"] = out["meta_info"]["output_top_logprobs"]
            found = BLENDED.findall(server.log())[blends:]  # this query's blend, if it ran
            agreement = compare(row["full"], row["blend"])
            rows.append({"tokens": row["tokens"], "full_s": row["full_s"],
                         "blend_s": row["blend_s"],
                         "kl_blend": answer_kl(row["full"], row["blend"], row["full_tops"],
                                               row["blend_tops"], args.kl_tokens),
                         "kl_first": agreement.kl,
                         "identical_blend": agreement.identical,
                         "full_answer": row["full"].text, "blend_answer": row["blend"].text,
                         "blend_loaded": int(found[-1][0]) if found else 0,
                         "blend_recomputed": int(found[-1][2]) if found else 0,
                         "fallback": row["fallback"]})
            r = rows[-1]
            print(f"query {q}: {r['tokens']} tokens, full {r['full_s']:.2f}s, blend "
                  f"{r['blend_s']:.2f}s ({r['blend_loaded']} loaded, {r['blend_recomputed']} "
                  f"recomputed{', fell back' if r['fallback'] else ''}) kl "
                  f"{r['kl_blend']:.4f} identical {r['identical_blend']}",
                  flush=True)
    finally:
        server.stop()
    ratio = [r["blend_s"] / r["full_s"] for r in rows]
    return {
        "engine": "sglang", "model": "SmolLM2-135M-Instruct float32", "args": vars(args),
        "tp": getattr(args, "tp", 1),
        "ttft_ratio": statistics.median(ratio), "ttft_ratio_p99": p99(ratio),
        "kl_blend": statistics.fmean(r["kl_blend"] for r in rows),
        "blended": sum(r["blend_loaded"] > 0 for r in rows),
        "fallbacks": sum(r["fallback"] for r in rows), "rows": rows,
    }
