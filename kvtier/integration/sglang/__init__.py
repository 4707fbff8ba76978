"""kvtier inside SGLang: a plugin adding `--enable-kvtier`, a radix-cache backend that loads and
stores through kvtier, and a HiCache L3 storage backend. One sub-package per concern:

    launch/    the plugin SGLang loads in every process, the launcher's checks (preflight),
               the model's identity and weights digest, the CPU engine and its shims
    rank/      one TP rank's scheduler side: the adapter over the engine, the radix-cache
               backend, its prefetch hooks, background stores, time budget, tier events
    blending/  blended prefill (`enable_blending`): the blender, its per-request chains,
               background jobs and worker, the radix tree's blend hooks
    admin/     tiers attached and detached over HTTP, and the TP ranks' gathered answers
    stop/      a bounded stop: HTTP grace, scheduler drains, the launcher's wait
    boundary/  the typed SGLang boundary: every internal kvtier reaches (`sglang_api`),
               the Protocol views (`sglang_views`) and the canary that checks them
    hicache/   the HiCache L3 storage backend

`import kvtier` never imports this package; SGLang imports `launch.plugin.register` through
the `sglang.srt.plugins` entry point, and the SGLang-facing modules (`rank.radix_cache`,
`hicache.storage`) import SGLang themselves. `plugin` and `hicache_storage` here are the
earlier module paths (the entry point and HiCache's `module_path`), kept importable.
"""

from __future__ import annotations

from kvtier.integration.sglang.launch.plugin import BACKEND_NAME, register

__all__ = ["BACKEND_NAME", "register"]
