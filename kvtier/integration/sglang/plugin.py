"""Deprecated path of `kvtier.integration.sglang.launch.plugin`, kept for entry points
installed before the move (`kvtier.integration.sglang.plugin:register`)."""

from __future__ import annotations

from kvtier.integration.sglang.launch.plugin import BACKEND_NAME, register

__all__ = ["BACKEND_NAME", "register"]
