"""The `kvtier` command: check-config, migrate-config, info, bench, demo, stats, ls, purge,
tiers.

Bad input (arguments, files, numbers, an unreachable server) is one line, `kvtier: error:
...`, and exit status 2, never a traceback (`-v` logs one); every network call has a timeout
(Redis: `remote_timeout_secs`), and a config file is read only when it is a regular file of at
most `MAX_CONFIG_BYTES` (a FIFO would block the read, /dev/zero never end it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
from pathlib import Path
from typing import NoReturn

import yaml

from kvtier.cli.args import add_command, add_config_file, positive
from kvtier.cli.info import info
from kvtier.config import load_config, load_config_report
from kvtier.errors import KVTierError

__all__ = ["main", "MAX_CONFIG_BYTES"]

MAX_CONFIG_BYTES = 1 << 20  # a config file is a few kB; anything this large is not one
_CONFIG_ENV = ("KVTIER_CONFIG_FILE", "LMCACHE_CONFIG_FILE")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one `kvtier: error:` line (no usage block), status 2."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.partition(" ")[2]
        self.exit(2, f"kvtier: error: {command + ': ' if command else ''}{message} (see "
                     f"{self.prog} --help)\n")


def _check_config(args: argparse.Namespace) -> int:
    """Print the key groups, the effective config and where each value came from, as one YAML
    document, then every problem a launch with these flags would hit on this host (all at
    once; the file may be meant for another host, so they are reported, exit status 1)."""
    if args.tp_size < 1:
        print(f"kvtier: error: --tp-size must be >= 1, got {args.tp_size}", file=sys.stderr)
        return 2
    from kvtier.integration.sglang.launch.preflight import preflight

    loaded = load_config_report(args.file)
    found = preflight(loaded.config, args)
    for problem in found.problems:
        print(f"kvtier: problem: on this host, {problem}", file=sys.stderr)
    for note in found.notes:
        print(f"kvtier: note: {note}", file=sys.stderr)
    translated = dict(loaded.notes)
    print(f"# source: {loaded.source}")
    print("# kvtier keys set by the file and the environment:")
    _dump({"kvtier_keys": {k: v for k, v in loaded.given if k not in translated}})
    print("# LMCache values kvtier translates (as migrate-config shows them):")
    _dump({"lmcache_translated": translated})
    print("# LMCache keys accepted but not implemented, and what kvtier does instead:")
    _dump({"lmcache_not_implemented": dict(loaded.ignored)})
    print("# the effective config:")
    _dump({"effective": loaded.config.redacted(), "tiers": " -> ".join(loaded.config.tiers)})
    print("# where each value came from (default, file, or the variable):")
    _dump({"origins": dict(loaded.origins)})
    if found.problems or found.notes:
        print(f"# a launch with --tp-size {args.tp_size} --page-size {args.page_size} on this "
              "host: refused for each problem; each note is logged")
        _dump({"launch_problems": found.problems, "launch_notes": found.notes})
    return 1 if found.problems else 0


def _migrate_config(args: argparse.Namespace) -> int:
    """Print what each key of an LMCache file becomes, then the kvtier keys it amounts to."""
    from kvtier.config.lmcache.migrate import explain, kvtier_yaml

    migration = explain(args.file)
    width = max((len(r.key) for r in migration.rows), default=0)
    for row in migration.rows:
        print(f"{row.key:<{width}}  {row.kind:<10}  {row.note}")
    if migration.loaded is None:
        print(f"kvtier: error: {migration.error}", file=sys.stderr)
        return 2
    print("\n# kvtier keys this file amounts to (effective values, credentials masked):")
    _dump(kvtier_yaml(migration.loaded.config, migration.rows))
    return 0


def _dump(data: dict[str, object]) -> None:
    print(yaml.safe_dump(data, sort_keys=False, width=100), end="")


def _bench(args: argparse.Namespace) -> int:
    from kvtier.cli.bench import run_bench

    if Path(args.json).is_dir():  # found before the bench runs, not after
        print(f"kvtier: error: --json {args.json} is a directory", file=sys.stderr)
        return 2
    result = run_bench(load_config(args.file), prompts=args.prompts, tokens=args.tokens,
                       progress=not args.quiet, real_tiers=args.real_tiers)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0




DESCRIPTION = """\
kvtier keeps the KV cache of LLM serving engines in CPU memory, on local disk and in Redis.
These commands check a config file before a launch, look at and clear what the disk and Redis
tiers hold, measure the tiers, and talk to a running server. A config FILE argument defaults
to $KVTIER_CONFIG_FILE, then $LMCACHE_CONFIG_FILE, then the built-in defaults."""

EPILOG = """\
start here:
  kvtier check-config kvtier.yaml     every problem a launch with this file would hit here
  kvtier info kvtier.yaml             versions, copy kernel, whether each tier is reachable
  kvtier demo                         real SGLang serving with and without kvtier (CPU)
errors are one line on stderr and exit status 2; -v logs more. Docs: docs/cli.md"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtier", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    p = add_command(sub, "check-config", "check a config file against this host and print the "
                 "effective values; every problem the launch would hit is reported at once")
    add_config_file(p)
    _add_launch_flags(p)
    p.set_defaults(func=_check_config)
    p = add_command(sub, "migrate-config", "explain what each key of an LMCache config file "
                 "becomes in kvtier")
    p.add_argument("file", metavar="FILE", help="the LMCache YAML file")
    p.set_defaults(func=_migrate_config)
    p = add_command(sub, "info", "show versions, the copy kernel in use and whether each tier of "
                 "a config is reachable (changes nothing)")
    add_config_file(p)
    p.add_argument("--sglang", action="store_true", help="also check the SGLang internals "
                   "kvtier uses (imports SGLang: several seconds)")
    p.set_defaults(func=info)
    p = add_command(sub, "bench", "measure store and load throughput of the tiers on a "
                 "Llama-3-8B-shaped KV cache")
    add_config_file(p)
    p.add_argument("--prompts", type=positive, default=8, help="prompts stored and loaded")
    p.add_argument("--tokens", type=positive, default=2048, help="tokens per prompt")
    p.add_argument("--json", default="benchmarks/results/bench.json", help="JSON output path")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--real-tiers", action="store_true", help="measure the configured disk "
                   "directory and Redis (the bench's records are deleted at the end); by "
                   "default a temporary directory, and no Redis")
    p.set_defaults(func=_bench)
    from kvtier.cli import admin as cli_admin
    from kvtier.cli import tiers as cli_tiers
    from kvtier.cli import verify as cli_verify
    from kvtier.demo import add_parser as add_demo_parser

    add_demo_parser(sub)
    cli_admin.add_parsers(sub)
    cli_tiers.add_parser(sub)
    cli_verify.add_parser(sub)
    return parser


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    """The SGLang launch flags the launch checks depend on, under SGLang's names."""
    p.add_argument("--tp-size", type=int, default=1, help="TP ranks on this host, each with "
                   "its own arena (default 1)")
    p.add_argument("--dp-size", type=positive, default=1, help="DP ranks on this host")
    p.add_argument("--page-size", type=positive, default=1, help="SGLang's --page-size "
                   "(chunk_size must be a multiple)")
    p.add_argument("--device", help="SGLang's --device: with cpu, the engine's KV pool and "
                   "weights share host memory with kvtier's arena and are counted")
    p.add_argument("--model-path", help="the model directory (its config.json and weights "
                   "size the CPU engine's memory)")
    p.add_argument("--max-total-tokens", type=positive, help="SGLang's KV pool size in tokens")
    p.add_argument("--load-format", default="auto", help="SGLang's --load-format")


def _config_file_problem(args: argparse.Namespace) -> str | None:
    """Why the config file this command would read (its `file`, else the variables) must not
    be read, or None; a missing file is left to the loader, which names it."""
    if not hasattr(args, "file") or getattr(args, "metrics", None):
        return None  # a command that reads no config file
    given = args.file
    path = given or next((os.environ[v] for v in _CONFIG_ENV if os.environ.get(v)), None)
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return f"{path}: cannot read config file: Is a directory"
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: cannot read config file: not a regular file (a FIFO, device or socket)"
    if st.st_size > MAX_CONFIG_BYTES:
        return f"{path}: cannot read config file: {st.st_size} bytes is not a config file"
    return None


def _describe(exc: Exception) -> str:
    """One line for an error a command did not turn into a `KVTierError` itself."""
    module = type(exc).__module__
    if module.startswith("redis"):  # redis-py: the server is unreachable, refuses, times out
        return f"Redis: {str(exc) or type(exc).__name__} (remote_url, remote_timeout_secs)"
    if isinstance(exc, OSError):
        return str(exc)
    return f"{type(exc).__name__}: {exc} (kvtier -v ... logs where)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = _config_file_problem(args)
    if problem is not None:
        print(f"kvtier: error: {problem}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except KVTierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # bad input must never end in a traceback
        if args.verbose:
            logging.getLogger(__name__).exception("kvtier %s failed", args.command)
        print(f"kvtier: error: {_describe(exc)}", file=sys.stderr)
        return 2

