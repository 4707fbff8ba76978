"""Command-line pieces both anchor benchmarks share: checked numbers, the arms, the model,
threads and the work directory, and progress lines on stderr."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.anchors.servers import ARMS, MODELS

__all__ = ["at_least", "add_common", "say"]


def at_least(kind: Callable[[str], float], minimum: float) -> Callable[[str], float]:
    """An argparse `type`: `kind(text)`, which must be >= `minimum` (a usage error names the
    value otherwise)."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {text}")
        return value
    return parse


def add_common(p: argparse.ArgumentParser) -> None:
    """--arms, --model, --threads, --seed and --work-dir."""
    p.add_argument("--arms", default=",".join(ARMS),
                   help=f"comma-separated subset of {','.join(ARMS)} (default: all)")
    p.add_argument("--model", choices=sorted(MODELS), default="small",
                   help="the generated Llama (kvtier.demo.models): small (hidden 384, 4 "
                        "layers, 4K context; default) or full (the demo's: hidden 512, 8 "
                        "layers, 16K)")
    p.add_argument("--threads", type=at_least(int, 0), default=0,
                   help="OMP threads per server (0: every core)")
    p.add_argument("--seed", type=int, default=0, help="prompt ids and arrival times")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep configs and server logs here (default: a temp dir, removed)")


def say(msg: str) -> None:
    """A progress line (stderr: stdout holds the report)."""
    print(msg, file=sys.stderr, flush=True)
