"""The `kvtier` command line: `main` dispatches; `admin` (ls/stats/purge over `inventory`),
`tiers` (attach/detach on a running server), `bench` (the quick store/retrieve benchmark)."""

from __future__ import annotations

from kvtier.cli.main import main

__all__ = ["main"]
