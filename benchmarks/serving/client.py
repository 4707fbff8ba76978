"""The serving benchmark's client, `python -m sglang.benchmark.serving`: its command line
and environment for one run, and its result file read into a `RunResult`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from benchmarks.serving.shared import Options, RunResult

CLIENT_TIMEOUT_S = 3600.0


# ---- the client ----

def client_command(opts: Options, port: int, model: Path, out: Path, system_len: int,
                   noreuse: bool) -> list[str]:
    """`sglang.benchmark.serving` for one run: the shared-prefix workload, or (`noreuse`) as
    many `random-ids` prompts of the same length, which share no prefix."""
    n = opts.num_groups * opts.prompts_per_group
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
           "--host", "127.0.0.1", "--port", str(port), "--tokenizer", str(model),
           "--max-concurrency", str(opts.max_concurrency), "--warmup-requests",
           str(opts.warmup_requests), "--output-file", str(out), "--output-details",
           "--cache-report", "--disable-tqdm", "--ready-check-timeout-sec", "30",
           *(["--tokenize-prompt"] if opts.tokenize_prompt else [])]
    if noreuse:
        return cmd + ["--dataset-name", "random-ids", "--seed", str(opts.noreuse_seed),
                      "--num-prompts", str(n),
                      "--random-input-len", str(system_len + opts.question_len),
                      "--random-output-len", str(opts.output_len), "--random-range-ratio", "1.0"]
    return cmd + ["--dataset-name", "generated-shared-prefix",
                  "--gsp-num-groups", str(opts.num_groups),
                  "--gsp-prompts-per-group", str(opts.prompts_per_group),
                  "--gsp-system-prompt-len", str(system_len),
                  "--gsp-question-len", str(opts.question_len),
                  "--gsp-output-len", str(opts.output_len)]


def client_env(home: Path) -> dict[str, str]:
    """Offline, with its own HOME: the shared-prefix dataset is cached under
    ~/.cache/sglang/benchmark keyed by the tokenizer's class name only, so another model's
    cached prompts must never be picked up."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVTIER_", "LMCACHE_", "SGLANG_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def parse_result(path: Path, result: RunResult) -> None:
    """Fill `result` from the client's JSONL result file (written with `--output-details`).

    A request counts as completed only if it has no error and a token arrived: the client
    counts a 200 answer whose stream carried an error instead of tokens (a prompt longer than
    the pool, ...) as a success with TTFT 0, so the TTFT statistics and the throughput are
    recomputed over the completed requests (as the client computes them: numpy mean, median,
    percentile).
    """
    if not path.exists():
        result.failed = result.requests
        result.errors.append("the client wrote no result (every request failed?)")
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    data = json.loads(lines[-1])
    errors: list[str] = data["errors"]
    ttfts: list[float] = data["ttfts"]
    texts: list[str] = data["generated_texts"]
    ok = [i for i, e in enumerate(errors) if not e and ttfts[i] > 0 and texts[i]]
    hollow = sum(1 for i, e in enumerate(errors) if not e and i not in ok)
    result.requests = len(errors)
    result.completed = len(ok)
    result.failed = result.requests - result.completed
    if hollow:
        result.errors.append(f"{hollow} request(s) answered 200 without an output token (an "
                             f"error inside the stream: see the server log)")
    result.errors += [e[:300] for e in errors if e][:5]
    result.duration_s = float(data["duration"])
    good = [ttfts[i] * 1e3 for i in ok]
    if good:
        result.mean_ttft_ms = float(np.mean(good))
        result.median_ttft_ms = float(np.median(good))
        result.p99_ttft_ms = float(np.percentile(good, 99))
    result.request_throughput = result.completed / result.duration_s
    result.input_tokens = int(data["total_input_tokens"])
    result.client_completed = int(data["completed"])
    report = data.get("cache_report") or {}
    if report.get("total_cached_tokens") is not None:
        result.cached_tokens = int(report["total_cached_tokens"])
