"""`kvtier stats | ls | purge`: what the disk and Redis tiers of a config hold; `kvtier stats
--metrics URL`: what a running server measured (its tier and prefill speeds, its load-or-
recompute decisions), read from its Prometheus endpoint; `kvtier purge --tenant SALT --server
URL`: running servers forget one tenant too (`kvtier.cli.forget`)."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from kvtier.cli.args import add_command, add_config_file
from kvtier.config import load_config
from kvtier.config.tiers import lower_tier_names
from kvtier.config.urls import redact_url
from kvtier.errors import ConfigError

__all__ = ["add_parsers"]


def _stats(args: argparse.Namespace) -> int:
    if args.metrics:
        return _live(args.metrics)
    from kvtier.cli import inventory  # imports torch (seconds): only for the commands using it

    summaries = inventory.summarize(load_config(args.file))
    if not summaries:
        print("no disk or Redis tier in this config (the CPU tier lives in a serving process; "
              "see its metrics)")
        return 0
    print(f"{'tier':<8}{'chunks':>10}{'GB':>10}{'models':>8}")
    for summary in summaries:
        held = summary.held
        if held is None:
            print(f"{summary.tier:<8}{'-':>10}{'-':>10}{'-':>8}  DOWN: {summary.error}")
            continue
        print(f"{summary.tier:<8}{held.records:>10}{held.nbytes / 1e9:>10.3f}"
              f"{len(held.models):>8}")
    return 0 if all(x.error is None for x in summaries) else 1


METRICS_TIMEOUT_S = 10.0
MAX_METRICS_BYTES = 64 << 20  # a scrape of every series of a big server is a few MB
_SAMPLE = re.compile(r"^(kvtier_[a-z0-9_]+)(?:\{([^}]*)\})?\s+(\S+)")


def _scrape(url: str) -> dict[tuple[str, str], float] | None:
    """`{(metric, tier label or ""): value}` of the kvtier samples at `url` (`_created`
    series left out: they are when a counter was made, not a measurement); None, with the
    error printed, when it cannot be read."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as resp:
            text = resp.read(MAX_METRICS_BYTES).decode(errors="replace")
    except (OSError, ValueError) as exc:  # URLError is an OSError; ValueError: not a URL
        print(f"kvtier: error: cannot read metrics from {redact_url(url)}: {exc}",
              file=sys.stderr)
        return None
    samples: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match[1].endswith("_created"):
            continue
        tier = re.search(r'tier="([^"]*)"', match[2] or "")
        try:
            samples[(match[1], tier[1] if tier else "")] = float(match[3])
        except ValueError:
            continue
    return samples


def _live(url: str) -> int:
    """A running server's tier and prefill speeds (measured, or still the prior: said so)
    and its load-or-recompute counts, from its /metrics."""
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    samples = _scrape(url)
    if samples is None:
        return 2
    prefill = samples.get(("kvtier_est_prefill_tokens_per_second", ""))
    if prefill is None:
        print(f"kvtier: {redact_url(url)} reports no kvtier estimates (is it a kvtier "
              "server's metrics endpoint, with --enable-metrics or metrics_port?)",
              file=sys.stderr)
        return 1
    measured = samples.get(("kvtier_est_prefill_measured", ""), 1.0)
    print(f"prefill: {prefill:,.0f} tokens/s "
          f"({'measured' if measured else 'prior, before the first measured prefill'})")
    tiers = sorted({t for (name, t) in samples if name == "kvtier_est_latency_seconds"})
    print(f"{'tier':<8}{'state':<7}{'round trip':>12}{'read':>13}  speeds")
    for tier in tiers:
        down = samples.get(("kvtier_down", tier), 0.0) > 0
        known = samples.get(("kvtier_est_measured", tier), 1.0) > 0
        latency = samples[("kvtier_est_latency_seconds", tier)]
        speed = samples.get(("kvtier_est_read_bytes_per_second", tier), 0.0)
        how = "measured" if known else "guessed (not measured yet)"
        print(f"{tier:<8}{'DOWN' if down else 'up':<7}{latency * 1e3:>9.2f} ms"
              f"{speed / 1e6:>9,.0f} MB/s  {how}")
    counts = sorted((name.removeprefix("kvtier_adaptive_").removesuffix("_total"), value)
                    for (name, _), value in samples.items()
                    if name.startswith("kvtier_adaptive_tokens_"))
    if counts:
        print("adaptive policy, prompt tokens:")
        for name, value in counts:
            print(f"  {name:<48}{value:>14,.0f}")
    return 0


def _ls(args: argparse.Namespace) -> int:
    from kvtier.cli import inventory

    listings = inventory.survey(load_config(args.file), args.model)
    rows = [g for x in listings for g in x.groups]
    down = [x for x in listings if x.error is not None]
    if not rows and not down:
        print("nothing stored" + (f" for model {args.model}" if args.model else ""))
        return 0
    print(f"{'tier':<7}{'chunks':>9}{'GB':>10}  model / layout")
    for g in rows:
        print(f"{g.tier:<7}{g.chunks:>9}{g.nbytes / 1e9:>10.3f}  {g.model} / {g.layout}")
    for x in down:
        print(f"{x.tier:<7}{'-':>9}{'-':>10}  DOWN: {x.error}")
    return 1 if down else 0


def _tenant_tag(config: Any, salt: str | None) -> str | None:
    """The tag of tenant `salt` in this config's key names (`kvtier.keys.tenant_tag`); None
    for none. Raises ConfigError naming `--tenant` for an empty salt (unsalted records have
    no tenant)."""
    if salt is None:
        return None
    from kvtier.keys import tenant_tag
    from kvtier.keys.record_keys import name_salt

    if not salt:
        raise ConfigError("--tenant: give the tenant's salt (a request's cache_salt); "
                          "records without one belong to no tenant")
    try:
        return tenant_tag(name_salt(config.hash_salt, config.record_key_file), salt)
    except ValueError as exc:
        raise ConfigError(f"--tenant: {exc}") from None


def _purge(args: argparse.Namespace) -> int:
    from kvtier.cli import inventory

    config = load_config(args.file)
    if args.model is not None and not args.model:
        raise ConfigError("--model: give the model's name as served (`kvtier ls` lists them); "
                          "leave it out to purge every model")
    tag = _tenant_tag(config, args.tenant)
    servers = args.server or []
    if servers:
        _check_servers(servers, tag, args.insecure)
    what = f"model {args.model}" if args.model else "every model"
    if tag is not None:
        what += f" of tenant tag t-{tag}"
    if not args.yes:
        lower = [t for t in config.tiers if t in lower_tier_names()]  # cpu may be off
        where = ", ".join(lower + [f"the CPU tiers of {s}" for s in map(redact_url, servers)])
        if not sys.stdin.isatty():
            print(f"kvtier: purge would delete {what} from {where or '-'};"
                  " not a terminal: pass --yes to confirm", file=sys.stderr)
            return 2
        listings = inventory.survey(config, args.model, tag)
        total = sum(g.chunks for x in listings for g in x.groups)
        also = f" and the tenant's chunks on {len(servers)} servers" if servers else ""
        answer = input(f"delete {total} chunks of {what} from the disk/Redis tiers{also}? "
                       "[y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    # The servers first: what they forget under the same keys leaves their own disk index,
    # and the config's purge then takes what no server's CPU tier held.
    served = True
    if servers:
        from kvtier.cli.forget import forget_on_servers
        from kvtier.cli.tiers import admin_key

        assert args.tenant is not None and tag is not None
        served = forget_on_servers(servers, args.tenant, tag, admin_key(args))
    listings = inventory.purge(config, args.model, tag)
    for x in listings:
        if x.error is not None:
            print(f"{x.tier}: DOWN, nothing deleted there: {x.error}")
        for g in x.groups:
            print(f"deleted {g.chunks} chunks ({g.nbytes / 1e9:.3f} GB) of {g.model} / "
                  f"{g.layout}{'' if tag is None else f' (tenant t-{tag})'} from {g.tier}")
    if not any(x.groups for x in listings):
        print("nothing to delete" + (" in the config's disk/Redis tiers" if servers else ""))
    return 1 if any(x.error is not None for x in listings) or not served else 0


def _check_servers(servers: list[str], tag: str | None, insecure: bool) -> None:
    """`--server` URLs are checked before anything is deleted; they need `--tenant` (a
    server's CPU tier is emptied of one tenant, never wholesale: `/flush_cache` does that)."""
    if tag is None:
        raise ConfigError("--server: give --tenant SALT too: a server forgets one tenant's "
                          "chunks (SGLang's /flush_cache empties its caches)")
    from kvtier.cli.forget import check_servers

    check_servers(servers, insecure)


def add_parsers(sub: Any) -> None:
    p = add_command(sub, "stats", "count the chunks and bytes each disk/Redis tier holds, or "
                    "show a running server's measured speeds (--metrics)")
    add_config_file(p)
    p.add_argument("--metrics", metavar="URL",
                   help="a server's metrics endpoint (SGLang's with --enable-metrics, or "
                        "kvtier's metrics_port): show its tier and prefill speed estimates "
                        "and its load-or-recompute counts")
    p.set_defaults(func=_stats)
    p = add_command(sub, "ls", "list what the disk/Redis tiers hold, per model and layout")
    add_config_file(p)
    p.add_argument("--model", help="only this model (the key's model name)")
    p.set_defaults(func=_ls)
    p = add_command(sub, "purge", "delete what the disk/Redis tiers hold (of one model with "
                    "--model)")
    add_config_file(p)
    p.add_argument("--model", help="only this model (the key's model name)")
    p.add_argument("--tenant", metavar="SALT",
                   help="only this tenant's records (a request's cache_salt), found by the "
                        "tenant tag in their key names; no other tenant's record is touched")
    p.add_argument("--server", action="append", metavar="URL",
                   help="with --tenant: a running SGLang server with kvtier that forgets the "
                        "tenant's chunks too (every TP rank's CPU tier, and the same keys in "
                        "its disk and Redis tiers), reporting counts per rank and tier; "
                        "repeat for a fleet. Needs its admin key (SGLANG_ADMIN_API_KEY or "
                        "--admin-key)")
    p.add_argument("--admin-key", help="the servers' --admin-api-key (better: "
                   "SGLANG_ADMIN_API_KEY, which the process list does not show)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plain http:// to a --server that is not loopback")
    p.add_argument("--yes", action="store_true", help="do not ask")
    p.set_defaults(func=_purge)
