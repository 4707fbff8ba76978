"""Argument helpers shared by the `kvtier` subcommands."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_command", "add_config_file", "positive"]


def positive(text: str) -> int:
    """An argparse `type`: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def add_config_file(parser: argparse.ArgumentParser) -> None:
    """The optional FILE argument every command reading a config takes."""
    parser.add_argument("file", nargs="?", metavar="FILE", help="kvtier or LMCache YAML config "
                        "(default: $KVTIER_CONFIG_FILE, $LMCACHE_CONFIG_FILE, built-in defaults)")


def add_command(sub: Any, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose one-line summary is also its --help description."""
    return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")
