"""The README's CPU launch line, as written, on the real model: what a user following the
README gets from a CPU-tier hit.

Starts `python -m sglang.launch_server` with exactly the README's CPU line (plus
`--model-path` to SmolLM2-135M-Instruct and a config of `chunk_size: 256`, a 2 GB CPU tier and
a disk tier), in an environment holding PATH and HOME only: no demo plugin, nothing kvtier's
own plugin does not do. For each of `--prompts` prompts of real text, `--tokens` long: the
first request computes it (the baseline, measured in the same run), `/flush_cache`, the same
prompt again loads it from kvtier's CPU tier. TTFT through SGLang's streaming endpoint; the
result is the hit's TTFT as a ratio to the miss's. Prints a table, writes
benchmarks/results/bench_readme_cpu.json.

    .venv/bin/python -m benchmarks.serving.bench_readme_cpu [--prompts 3]
        [--tokens 2048]

Needs the SGLang CPU environment (`make sglang-env`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import SGLANG, real_model, work_dir, write_results
from benchmarks.serving.adaptive_report import p99
from kvtier.demo.quality import documents
from kvtier.demo.server import SGLangServer

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_cpu_launch() -> list[str]:
    """The README's CPU launch line, after `python -m sglang.launch_server`."""
    lines = [line for line in README.read_text().splitlines()
             if line.startswith("python -m sglang.launch_server") and "--device cpu" in line]
    if len(lines) != 1:
        raise ValueError(f"README must show one CPU launch line, found {lines}")
    return shlex.split(lines[0])[3:]


def bare_server(model: Path, log: Path, args: Sequence[str]) -> SGLangServer:
    """A server started with `args` as given, in an environment of PATH and HOME only (the
    launcher is this venv's python, as `python` on a user's PATH would be)."""
    server = SGLangServer(model, log, args=args, cpu_flags=[])
    server.env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
                  "HOME": os.environ.get("HOME", "/root")}
    return server


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    model = real_model("bench_readme_cpu", SGLANG)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    config = work / "kvtier.yaml"
    config.write_text(f"chunk_size: 256\nmax_local_cpu_size: 2\nlocal_disk: {work / 'disk'}\n"
                      "max_local_disk_size: 2\n")
    launch = readme_cpu_launch()
    flags = [str(config) if a == "kvtier.yaml" else a for a in launch[2:]]
    rows = []
    with bare_server(model, work / "server.log", flags) as server:
        warm = tokenizer.encode(documents(1, facts=60, seed=99)[0])[:1500]
        server.generate(warm, 2)  # a process's first prefill pays one-time costs
        server.flush_cache()
        for seed in range(args.prompts):
            text = documents(1, facts=args.tokens // 12, seed=seed)[0]
            ids = tokenizer.encode(text)[:args.tokens]
            miss = server.stream_generate(ids, 8)
            server.flush_cache()
            hit = server.stream_generate(ids, 8)
            server.flush_cache()
            rows.append({"prompt_tokens": len(ids), "miss_ttft_s": miss.ttft_s,
                         "hit_ttft_s": hit.ttft_s, "hit_tokens": hit.cached_tokens,
                         "ratio": hit.ttft_s / miss.ttft_s,
                         "identical": miss.output_ids == hit.output_ids})
        fix = "computes the new tokens' attention only" in server.log()
    ratios = [r["ratio"] for r in rows]
    return {"launch": ["python", "-m", "sglang.launch_server", *launch], "model": model.name,
            "rows": rows, "median_ratio": statistics.median(ratios), "p99_ratio": p99(ratios),
            "median_miss_s": statistics.median(r["miss_ttft_s"] for r in rows),
            "median_hit_s": statistics.median(r["hit_ttft_s"] for r in rows),
            "cpu_prefix_attention_logged": fix}


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{' '.join(result['launch'])}\n(model {result['model']})")
    print(f"{'prompt':>7} {'miss TTFT':>10} {'hit TTFT':>9} {'hit tok':>8} {'ratio':>6} same")
    for r in result["rows"]:
        print(f"{r['prompt_tokens']:>7} {r['miss_ttft_s']:>9.3f}s {r['hit_ttft_s']:>8.3f}s "
              f"{r['hit_tokens']:>8} {r['ratio']:>5.2f}x {r['identical']}")
    print(f"median: {result['median_hit_s']:.3f}s vs {result['median_miss_s']:.3f}s "
          f"({result['median_ratio']:.2f}x), p99 ratio {result['p99_ratio']:.2f}x; "
          f"kvtier's CPU attention fix logged: {result['cpu_prefix_attention_logged']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    with work_dir("readme-cpu", args.work_dir) as work:
        result = run(args, work)
    print_table(result)
    write_results("bench_readme_cpu", result)


if __name__ == "__main__":
    main()
