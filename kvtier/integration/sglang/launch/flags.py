"""The launcher's side of the plugin: kvtier's flags on SGLang's argument parser, and what
they check and set up in the launcher before any worker starts.

    --enable-kvtier             selects `--radix-cache-backend kvtier`
    --kvtier-config-file FILE   kvtier's YAML config (else KVTIER_CONFIG_FILE, else
                                LMCACHE_CONFIG_FILE, else defaults)

The config is validated here, in the launcher (`check_launch`: one `ConfigError` naming each
problem, printed as one line), and reaches the scheduler processes through
`KVTIER_CONFIG_FILE` (they inherit the launcher's environment). The plugin (`plugin.register`)
installs the two `around_` hooks around SGLang's parsing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, cast

from kvtier.config import Config, load_config
from kvtier.errors import ConfigError
from kvtier.integration.sglang.boundary.sglang_views import LaunchArgsView, Opaque

if TYPE_CHECKING:
    from kvtier.integration.sglang.boundary.sglang_views import ServerArgsView

__all__ = ["BACKEND_NAME", "around_add_cli_args", "around_from_cli_args", "check_launch"]

logger = logging.getLogger(__name__)

BACKEND_NAME = "kvtier"  # the radix-cache backend `--enable-kvtier` selects


def around_add_cli_args(original: Callable[..., Opaque],
                        parser: argparse.ArgumentParser) -> Opaque:
    """Around SGLang's `ServerArgs.add_cli_args`: kvtier's two flags in a group of their own."""
    out = original(parser)
    group = parser.add_argument_group("kvtier")
    group.add_argument("--enable-kvtier", action="store_true",
                       help="Keep KV in kvtier's CPU/disk/Redis tiers (sets "
                            "--radix-cache-backend kvtier).")
    group.add_argument("--kvtier-config-file", default=None,
                       help="kvtier YAML config; default: $KVTIER_CONFIG_FILE, then "
                            "$LMCACHE_CONFIG_FILE, then built-in defaults.")
    return out


def around_from_cli_args(original: Callable[..., Opaque], cls: type,
                         args: LaunchArgsView) -> Opaque:
    """Around SGLang's `ServerArgs.from_cli_args`, in the launcher: `--enable-kvtier` selects
    the backend; with it, the config is loaded and checked (`ConfigError`, one line), a CPU
    engine prepared, the model's key computed once and the admin routes and bounded stop set
    up, all before SGLang builds its arguments and starts a worker."""
    _one_line_launch_errors()
    # every server on this install, with kvtier or not (a demo's baseline too)
    logging.getLogger("sglang.srt.entrypoints.http_server").addFilter(_FreezeGcRace())
    enabled = bool(getattr(args, "enable_kvtier", False))
    config_file = getattr(args, "kvtier_config_file", None)
    if config_file and not enabled and args.radix_cache_backend != BACKEND_NAME:
        raise ConfigError("--kvtier-config-file needs --enable-kvtier")
    if enabled:
        if args.radix_cache_backend not in (None, BACKEND_NAME):
            raise ConfigError(f"--enable-kvtier conflicts with --radix-cache-backend "
                              f"{args.radix_cache_backend}")
        args.radix_cache_backend = BACKEND_NAME
    if args.radix_cache_backend == BACKEND_NAME:
        if config_file:
            os.environ["KVTIER_CONFIG_FILE"] = os.path.abspath(config_file)
        config = load_config()
        if getattr(args, "device", None) == "cpu":  # before any worker starts: they inherit it
            from kvtier.integration.sglang.launch.cpu import prepare_cpu_engine

            for change in prepare_cpu_engine(huge_pages=config.huge_pages,
                                             prefix_attention=config.cpu_prefix_attention,
                                             ranks=_worker_ranks(args)):
                logger.info("kvtier: --device cpu: %s", change)
        # Fail in the launcher, with the file and key named, not later in a worker.
        check_launch(config, args)
        from kvtier.integration.sglang.launch.identity import model_fingerprint

        # reads the weights once, here; the workers read the cache
        model_fingerprint(cast("ServerArgsView", args))
        _add_http_routes()
        _bounded_stop()
    return original(cls, args)


class _FreezeGcRace(logging.Filter):
    """SGLang posts `/freeze_gc` to itself once it is up; under `--skip-server-warmup` that
    request can reach the port before uvicorn binds it, and SGLang logs a 70-line traceback
    for what only means garbage collection was not frozen. Keeps its one line, explained."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.getMessage() == "post-warmup freeze_gc failed":
            record.msg = ("post-warmup freeze_gc failed: the request raced the HTTP server's "
                          "start (--skip-server-warmup); harmless, garbage collection is just "
                          "not frozen (traceback dropped by kvtier)")
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


def _worker_ranks(args: LaunchArgsView) -> int:
    """The scheduler processes SGLang starts, each binding its own cores on a CPU."""
    sizes = (getattr(args, name, 1) for name in ("dp_size", "tp_size", "pp_size"))
    ranks = 1
    for size in sizes:
        ranks *= int(size or 1)
    return ranks


def _bounded_stop() -> None:
    """A signal stops this server within seconds and lets kvtier write what it has queued
    (shutdown.py); the children learn they are a server's from `LAUNCHER_ENV`."""
    from kvtier.integration.sglang.stop import http_stop, shutdown

    shutdown.prepare_launcher(http_stop.install)
    try:
        import uvicorn
    except ImportError:  # SGLang's HTTP server is uvicorn; without it there is nothing to bound
        return
    http_stop.bound_http_grace(uvicorn.Server)


def _one_line_launch_errors() -> None:
    """In the launcher, a kvtier `ConfigError` nobody catches ends the process with one line
    naming the problem (exit status 1), not a traceback through SGLang's argument parsing.
    Other exceptions keep the hook that was there. Idempotent."""
    previous = sys.excepthook
    if getattr(previous, "kvtier", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, ConfigError):
            print(f"kvtier: {exc}", file=sys.stderr)
            return
        previous(kind, exc, tb)

    hook.kvtier = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _add_http_routes() -> None:
    """`/kvtier/tiers` on SGLang's HTTP app (this is the launcher, which serves it)."""
    from sglang.srt.entrypoints import http_server

    from kvtier.integration.sglang.admin import routes as admin

    admin.add_routes(http_server.app)


def check_launch(config: Config, args: LaunchArgsView) -> None:
    """Every launch check at once (`preflight`): one `ConfigError` naming the config's source
    and each problem, before any worker starts or anything is written."""
    from kvtier.integration.sglang.launch.preflight import preflight

    source = os.environ.get("KVTIER_CONFIG_FILE") or os.environ.get("LMCACHE_CONFIG_FILE") \
        or "kvtier defaults"
    for flag in ("enable_hierarchical_cache", "disable_radix_cache"):
        if getattr(args, flag, False):
            raise ConfigError(f"--enable-kvtier cannot be combined with "
                              f"--{flag.replace('_', '-')}")
    found = preflight(config, args)
    for note in found.notes:
        logger.warning("kvtier: %s", note)
    if len(found.problems) == 1:
        raise ConfigError(f"{source}: {found.problems[0]}")
    if found.problems:
        listed = "".join(f"\n  {i}. {p}" for i, p in enumerate(found.problems, 1))
        raise ConfigError(f"{source}: {len(found.problems)} problems stop the launch (kvtier "
                          f"check-config FILE lists them too):{listed}")
