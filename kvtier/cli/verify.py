"""`kvtier verify`: shadow verification on a running SGLang server with kvtier.

    kvtier verify --server http://127.0.0.1:30000                  # the share, and per rank and
                                                                  # tier: chunks checked, mismatched
    kvtier verify --server URL --fraction 0.01                    # verify 1% of the hits from now
    kvtier verify --server URL --scope tail                       # compute only a hit's last chunk

A verified request is computed, and what it computed is compared with what every tier holds
for the same chunks (docs/verification.md): its whole prompt (scope full: it loads nothing), or
the last full chunk of its hit over the loaded prefix (scope tail). The share and scope apply
on every TP rank until the server restarts (the config's `verify_fraction` and `verify_scope`
then apply again).
Talks to the server's `/kvtier/tiers` route like `kvtier tiers`; changing the share or scope needs
SGLang's admin key: the server launched with `--admin-api-key KEY`, the same key in
`SGLANG_ADMIN_API_KEY` (or `--admin-key`). A 401 or 403 is one error line that says so.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
from typing import Any

import yaml

from kvtier.cli.tiers import ADMIN_KEY_ENV, admin_key, check_server, refusal, request
from kvtier.config.schema import VERIFY_SCOPES
from kvtier.config.urls import redact_url

__all__ = ["add_parser"]


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fraction wants a number in [0, 1], got "
                                         f"{text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"--fraction wants a number in [0, 1], got {value:g}")
    return value


def _run(args: argparse.Namespace) -> int:
    check_server(args.server, args.insecure)
    change = {k: v for k, v in (("fraction", args.fraction), ("scope", args.scope))
              if v is not None}
    body = {"op": "verify", **change} if change else None
    key = admin_key(args)
    try:
        status, answer = request(args.server, body, key)
    except (urllib.error.URLError, OSError) as exc:
        print(f"kvtier: error: cannot reach {redact_url(args.server)}: {exc}", file=sys.stderr)
        return 2
    refused = refusal(args.server, status, answer, key_sent=key is not None)
    if refused is not None:
        print(refused, file=sys.stderr)
        return 1
    ranks = answer.get("ranks")
    shown: dict[str, Any] = {"success": answer.get("success", False)}
    if isinstance(ranks, list):
        shown["ranks"] = [{k: r.get(k) for k in ("verify_fraction", "verify_scope", "verified",
                                                 "error")
                           if k in r} for r in ranks if isinstance(r, dict)]
    elif "error" in answer or "detail" in answer:
        shown["error"] = answer.get("error", answer.get("detail"))
    print(yaml.safe_dump(shown, sort_keys=False), end="")
    return 0 if status == 200 and answer.get("success") else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("verify", help="show or set the share of hits a running SGLang server "
                       "verifies (computes, and compares with the tiers)")
    p.add_argument("--server", required=True, help="the SGLang server's URL (https://, or "
                   "http:// to a loopback address)")
    p.add_argument("--fraction", type=_fraction, help="the share of requests that would hit "
                   "to verify from now on, 0-1 (0: off); without it, show the share and counts")
    p.add_argument("--scope", choices=VERIFY_SCOPES, help="what a verified request computes: "
                   "full (its whole prompt) or tail (the last full chunk of its hit, the prefix "
                   "loaded)")
    p.add_argument("--admin-key", help=f"the server's --admin-api-key, which --fraction and "
                   f"--scope need (better: {ADMIN_KEY_ENV}, which the process list does not "
                   "show)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plain http:// to a host that is not loopback")
    p.set_defaults(func=_run)
