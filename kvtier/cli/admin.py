"""`kvtier stats | ls | purge`: what the disk and Redis tiers of a config hold; `kvtier stats
--metrics URL`: what a running server measured (its tier and prefill speeds, its load-or-
recompute decisions), read from its Prometheus endpoint."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli import inventory
from kvtier.config import load_config
from kvtier.config.names import CPU
from kvtier.config.urls import redact_url

__all__ = ["add_parsers"]


def _stats(args: argparse.Namespace) -> int:
    if args.metrics:
        return _live(args.metrics)
    config = load_config(args.file)
    per_tier: dict[str, list[int]] = {t: [0, 0] for t in config.tiers if t != CPU}
    models: dict[str, set[str]] = {}
    for g in inventory.groups(config):
        per_tier.setdefault(g.tier, [0, 0])
        per_tier[g.tier][0] += g.chunks
        per_tier[g.tier][1] += g.nbytes
        models.setdefault(g.tier, set()).add(g.model)
    if not per_tier:
        print("no disk or Redis tier in this config (the CPU tier lives in a serving process; "
              "see its metrics)")
        return 0
    print(f"{'tier':<8}{'chunks':>10}{'GB':>10}{'models':>8}")
    for tier, (chunks, nbytes) in per_tier.items():
        print(f"{tier:<8}{chunks:>10}{nbytes / 1e9:>10.3f}{len(models.get(tier, ())):>8}")
    return 0


# What `--metrics` shows: the adaptive policy's estimates and decisions.
_LIVE_PREFIXES = ("kvtier_est_", "kvtier_adaptive_tokens_")
METRICS_TIMEOUT_S = 10.0
MAX_METRICS_BYTES = 64 << 20  # a scrape of every series of a big server is a few MB


def _live(url: str) -> int:
    """Print the estimates and load-or-recompute counters a server's /metrics reports."""
    import urllib.request

    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as resp:
            text = resp.read(MAX_METRICS_BYTES).decode(errors="replace")
    except (OSError, ValueError) as exc:  # URLError is an OSError; ValueError: not a URL
        print(f"kvtier: error: cannot read metrics from {redact_url(url)}: {exc}",
              file=sys.stderr)
        return 2
    rows = []
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith(_LIVE_PREFIXES):
            try:
                rows.append((name, float(value)))
            except ValueError:
                continue  # not a sample line (or a timestamp after the value): skipped
    if not rows:
        print(f"kvtier: {redact_url(url)} reports no kvtier estimates (is it a kvtier "
              "server's metrics endpoint, with --enable-metrics or metrics_port?)",
              file=sys.stderr)
        return 1
    for name, number in sorted(rows):
        print(f"{name:<72}{number:>16.6g}")
    return 0


def _ls(args: argparse.Namespace) -> int:
    rows = inventory.groups(load_config(args.file), args.model)
    if not rows:
        print("nothing stored" + (f" for model {args.model}" if args.model else ""))
        return 0
    print(f"{'tier':<7}{'chunks':>9}{'GB':>10}  model / layout")
    for g in rows:
        print(f"{g.tier:<7}{g.chunks:>9}{g.nbytes / 1e9:>10.3f}  {g.model} / {g.layout}")
    return 0


def _purge(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    what = f"model {args.model}" if args.model else "every model"
    if not args.yes:
        if not sys.stdin.isatty():
            print(f"kvtier: purge would delete {what} from {', '.join(config.tiers[1:]) or '-'};"
                  " not a terminal: pass --yes to confirm", file=sys.stderr)
            return 2
        rows = inventory.groups(config, args.model)
        total = sum(g.chunks for g in rows)
        answer = input(f"delete {total} chunks of {what} from the disk/Redis tiers? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    deleted = inventory.purge(config, args.model)
    for g in deleted:
        print(f"deleted {g.chunks} chunks ({g.nbytes / 1e9:.3f} GB) of {g.model} / {g.layout} "
              f"from {g.tier}")
    if not deleted:
        print("nothing to delete")
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("stats", help="chunks and bytes per disk/Redis tier of a config, or a "
                                     "running server's measured speeds (--metrics)")
    p.add_argument("file", nargs="?")
    p.add_argument("--metrics", metavar="URL",
                   help="a server's metrics endpoint (SGLang's with --enable-metrics, or "
                        "kvtier's metrics_port): show its tier and prefill speed estimates "
                        "and its load-or-recompute counts")
    p.set_defaults(func=_stats)
    p = sub.add_parser("ls", help="what the disk/Redis tiers hold, per model and layout")
    p.add_argument("file", nargs="?")
    p.add_argument("--model", help="only this model (the key's model name)")
    p.set_defaults(func=_ls)
    p = sub.add_parser("purge", help="delete what the disk/Redis tiers hold")
    p.add_argument("file", nargs="?")
    p.add_argument("--model", help="only this model (the key's model name)")
    p.add_argument("--yes", action="store_true", help="do not ask")
    p.set_defaults(func=_purge)
