"""`kvtier purge --tenant SALT --server URL`: running servers forget one tenant.

Each `--server` gets the admin op `{"op": "purge", "tenant": SALT}` on its `/kvtier/tiers`
route (SGLang's admin key: `SGLANG_ADMIN_API_KEY` or `--admin-key`, as `kvtier tiers`), which
every TP rank applies to its own engine (`kvtier.engine.tenants.forget_tenant`): the tenant's
chunks leave the rank's CPU tier and, under the same keys, its disk and Redis tiers. The
answer names the tenant by its keyed tag only; this command prints that tag and the counts per
server, rank and tier, never the salt. A server whose tag differs from the config's means the
two name records differently (another `hash_salt` or `record_key_file`): said, since the
config's inventory purge would then miss that server's records.

The salt crosses the wire in the POST's body: a plain `http://` server that is not loopback
is refused unless `--insecure` (`kvtier.cli.tiers.check_server`).
"""

from __future__ import annotations

import sys
import urllib.error
from collections.abc import Sequence
from typing import Any

from kvtier.cli.tiers import TiersError, check_server, refusal, request
from kvtier.config.urls import redact_url
from kvtier.keys import TAG_PREFIX

__all__ = ["check_servers", "forget_on_servers"]


def check_servers(servers: Sequence[str], insecure: bool) -> None:
    """`TiersError` for the first URL `check_server` refuses: before anything is deleted."""
    for server in servers:
        check_server(server, insecure)


def forget_on_servers(servers: Sequence[str], salt: str, tag: str,
                      admin_key: str | None) -> bool:
    """Ask each server to forget tenant `salt` (config tag `tag`), printing what each rank
    deleted; whether every server answered with a purge on every rank."""
    ok = True
    for server in servers:
        ok = _forget_on(server, salt, tag, admin_key) and ok
    return ok


def _forget_on(server: str, salt: str, tag: str, admin_key: str | None) -> bool:
    shown = redact_url(server)
    try:
        status, answer = request(server, {"op": "purge", "tenant": salt}, admin_key)
    except (urllib.error.URLError, OSError, TiersError) as exc:
        print(f"{shown}: nothing deleted there: cannot reach it: {exc}")
        return False
    refused = refusal(server, status, answer, key_sent=admin_key is not None)
    if refused is not None:
        print(refused, file=sys.stderr)
        return False
    ranks = answer.get("ranks")
    if status != 200 or not isinstance(ranks, list):
        said = answer.get("error", answer.get("detail", f"HTTP {status}"))
        print(f"{shown}: nothing deleted there: {said}")
        return False
    ok = bool(answer.get("success"))
    for dp, each in enumerate(ranks):
        where = shown if len(ranks) == 1 else f"{shown} dp {dp}"
        ok = _report(where, each, tag) and ok
    return ok


def _report(where: str, answer: Any, tag: str) -> bool:
    """Print one DP group's answer: each TP rank's counts (`tp_answers.gather_ranks`)."""
    purged = answer.get("purged") if isinstance(answer, dict) else None
    if not isinstance(purged, list):
        said = answer.get("error") if isinstance(answer, dict) else None
        print(f"{where}: no purge: {said or 'not a kvtier purge answer'}")
        return False
    ok = True
    for rank in purged:
        at = f"{where} rank {rank.get('tp_rank', '?')}"
        if not isinstance(rank.get("chunks"), dict):
            print(f"{at}: nothing deleted there: {rank.get('error', 'no counts')}")
            ok = False
            continue
        counts = ", ".join(f"{n} from {tier}" for tier, n in rank["chunks"].items())
        named = str(rank.get("tenant", ""))
        print(f"{at}: deleted {counts or 'nothing'} (tenant {named})")
        if named != f"{TAG_PREFIX}{tag}":
            print(f"{at}: warning: the server names this tenant {named}, this config "
                  f"{TAG_PREFIX}{tag}: their hash_salt or record_key_file differ, so the "
                  "config's purge below cannot find that server's records")
    return ok
