"""`kvtier demo`: a real SGLang server with and without kvtier on a multi-turn workload.

Submodules: `models` (locally generated random-weight models), `server` (SGLang server
processes), `workload` (the conversations), `runner` (the measurement), `report` (output).
Importing this package imports neither torch nor SGLang.
"""

from __future__ import annotations

from kvtier.demo.cli import add_parser, run_command

__all__ = ["add_parser", "run_command"]
