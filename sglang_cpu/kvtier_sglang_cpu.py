"""SGLang plugin (entry point `kvtier_cpu_fixes`) for the demo's and the benchmarks' servers.

- Both arms of a comparison compute alike: the baseline server (no kvtier) gets the same
  extend over a cached prefix that kvtier's plugin installs for a `--device cpu` server
  (`kvtier.integration.sglang.launch.cpu_attention`, config key `cpu_prefix_attention`), so a ratio
  measures what the cache saves, not the attention fix. Installing it twice is a no-op.
- With `KVTIER_BENCH_FORWARD_LOG=PATH` (benchmarks only) it also appends one line per model
  forward to PATH: its end (wall clock), extend or decode, its tokens, its wall seconds and the
  seconds the calling thread ran on a core meanwhile. A forward whose wall time exceeds its CPU
  time waited for a core another thread or process held; the same CPU time for the same tokens
  on two servers means they compute alike.

Loaded by every SGLang process that has this directory on its PYTHONPATH; never part of the
kvtier package.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, TextIO


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvtier.integration.sglang.launch import cpu_attention

    cpu_attention.install()
    if os.environ.get(_FORWARD_LOG):
        HookRegistry.register(_FORWARD, _timed_forward, HookType.AROUND)


_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
_FORWARD_LOG = "KVTIER_BENCH_FORWARD_LOG"
_log: list[TextIO] = []
_log_lock = threading.Lock()


def _timed_forward(original: Any, self: Any, forward_batch: Any, *args: Any,
                   **kwargs: Any) -> Any:
    wall, cpu = time.perf_counter(), time.thread_time()
    try:
        return original(self, forward_batch, *args, **kwargs)
    finally:
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        extend = forward_batch.forward_mode.is_extend()
        tokens = (int(getattr(forward_batch, "extend_num_tokens", 0) or 0) if extend
                  else int(forward_batch.batch_size))
        with _log_lock:
            if not _log:
                _log.append(open(os.environ[_FORWARD_LOG], "a", buffering=1))  # noqa: SIM115
            _log[0].write(f"{time.time():.3f} {'extend' if extend else 'decode'} {tokens} "
                          f"{wall:.6f} {cpu:.6f}\n")
