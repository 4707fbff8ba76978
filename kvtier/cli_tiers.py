"""`kvtier tiers`: list, attach and detach the tiers of a running SGLang server with kvtier.

    kvtier tiers --server http://127.0.0.1:30000                      # list, per TP rank
    kvtier tiers --server URL attach redis --set remote_url=redis://h:6379
    kvtier tiers --server URL detach redis [--no-drain]

Talks to the server's `/kvtier/tiers` route; `--admin-key` (or `SGLANG_ADMIN_API_KEY`) when the
server was started with `--admin-api-key`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

import yaml

__all__ = ["add_parser", "request"]


def request(server: str, body: dict[str, Any] | None, admin_key: str | None = None,
            timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    """GET (no body) or POST `body` to `server`'s `/kvtier/tiers`; (HTTP status, JSON)."""
    url = server.rstrip("/") + "/kvtier/tiers"
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if admin_key:
        headers["Authorization"] = f"Bearer {admin_key}"
    req = urllib.request.Request(url, data=data, headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except json.JSONDecodeError:
            return exc.code, {"error": raw.decode(errors="replace")}


def _setting(text: str) -> tuple[str, Any]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"--set wants key=value, got {text!r}")
    return key, yaml.safe_load(value)


def _run(args: argparse.Namespace) -> int:
    body: dict[str, Any] | None = None
    if args.action == "attach":
        body = {"op": "attach", "tier": args.tier, "config": dict(args.set or [])}
    elif args.action == "detach":
        body = {"op": "detach", "tier": args.tier, "drain": not args.no_drain}
    try:
        status, answer = request(args.server, body, args.admin_key)
    except (urllib.error.URLError, OSError) as exc:
        print(f"kvtier: error: cannot reach {args.server}: {exc}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(answer, sort_keys=False), end="")
    return 0 if status == 200 and answer.get("success") else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tiers", help="list, attach or detach tiers of a running SGLang server")
    p.add_argument("--server", required=True, help="the SGLang server's URL")
    p.add_argument("--admin-key", default=os.environ.get("SGLANG_ADMIN_API_KEY"),
                   help="the server's --admin-api-key, if it has one")
    p.add_argument("action", nargs="?", choices=("list", "attach", "detach"), default="list")
    p.add_argument("tier", nargs="?", choices=("disk", "redis"))
    p.add_argument("--set", action="append", type=_setting, metavar="KEY=VALUE",
                   help="a kvtier config key for the attached tier (repeatable)")
    p.add_argument("--no-drain", action="store_true",
                   help="detach: drop the tier's queued writes instead of writing them")
    p.set_defaults(func=_check_and_run)


def _check_and_run(args: argparse.Namespace) -> int:
    if args.action != "list" and args.tier is None:
        print(f"kvtier: error: tiers {args.action} needs a tier name (disk or redis)",
              file=sys.stderr)
        return 2
    return _run(args)
