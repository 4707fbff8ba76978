"""kvtier inside SGLang: a plugin adding `--enable-kvtier`, a radix-cache backend that loads and
stores through kvtier, and a HiCache L3 storage backend.

`import kvtier` never imports this package; SGLang imports `plugin.register` through the
`sglang.srt.plugins` entry point, and the SGLang-facing modules (`radix_cache`,
`hicache_storage`) import SGLang themselves.
"""

from __future__ import annotations

from kvtier.integration.sglang.plugin import BACKEND_NAME, register

__all__ = ["BACKEND_NAME", "register"]
