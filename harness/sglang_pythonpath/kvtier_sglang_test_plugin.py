"""Test-only SGLang plugin (entry point `kvtier_test_fixes`): CPU fixes for tiny test models,
a quicker start to a SIGTERM stop, and (with `KVTIER_TEST_FORK_CHILDREN=1`) children forked
rather than spawned, so that they do not import SGLang again: a third of the CPU time of a
start.

Under `--attention-backend torch_native` SGLang's DeepSeek dispatcher has no handler and falls
back to the Triton one, which picks the MHA path for a prefix-free prefill; on the CPU
torch_native backend that path fails on MLA shapes. Dispatching every torch_native forward to
the MLA method (which torch_native implements) makes tiny DeepSeek-style models serve on CPU.

SGLang's SIGTERM watchdog looks at its flag every 5 s, so a stopped server idles 2.5 s on
average before its stop begins: about two minutes over the suite's 50 servers. Here it looks
every 0.1 s; what the stop then does is SGLang's own, unchanged.

`KVTIER_TEST_SKEW_SEGMENTS=PATH`: while the file PATH exists, a fault that computes the same
wrong KV every time, where the file says (read per call: a zygote's servers get their
environment after the plugin loaded):
- `records`: in whatever computes segments alone for the segment worker, its records and its
  checks of them (`SegmentWorker._prefill`): layer 2's values 5% off. Only a comparison with
  SGLang's KV of a prompt's first segment can see it (`engine_check`).
- `kvtier`: in kvtier's own forward (`blend_worker.prefill`): layer 3's values 5% off. Where
  SGLang's model computes the segments (TP 1, its CPU engine), no record or check reads it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
from typing import Any

WATCHDOG_POLL_S = 0.1
FORK_ENV = "KVTIER_TEST_FORK_CHILDREN"
SKEW_ENV = "KVTIER_TEST_SKEW_SEGMENTS"


def _fork_children() -> None:
    """SGLang's children forked, not spawned: each would otherwise import SGLang again
    (about 9 CPU-seconds a child, two or three a server)."""
    real = multiprocessing.set_start_method

    def set_start_method(method: str | None, force: bool = False) -> None:
        real("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = set_start_method  # type: ignore[assignment]
    # What a spawned child does as it loads kvtier's plugin (a forked one loads nothing): the
    # first Ctrl-C left to the launcher, the exit unfinalized.
    from kvtier.integration.sglang.stop.shutdown import set_up_server_child

    os.register_at_fork(after_in_child=set_up_server_child)
    if multiprocessing.get_start_method(allow_none=True) == "spawn":  # set before plugins load
        real("fork", force=True)


class _QuickWatchdogAsyncio:
    """`asyncio` as SGLang's tokenizer manager sees it: the same, but the SIGTERM watchdog's
    5-second sleeps take `WATCHDOG_POLL_S`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    @staticmethod
    def sleep(delay: float, result: Any = None) -> Any:
        if sys._getframe(1).f_code.co_name == "sigterm_watchdog":
            delay = min(delay, WATCHDOG_POLL_S)
        return asyncio.sleep(delay, result)


def register() -> None:
    if os.environ.get(FORK_ENV) == "1":
        _fork_children()
    from sglang.srt.managers import tokenizer_manager

    tokenizer_manager.asyncio = _QuickWatchdogAsyncio()  # type: ignore[assignment]
    _register_mla_dispatch()
    _skewable_segment_forward()


def _skew() -> str:
    """Where the fault is on now (`SKEW_ENV`'s file's text), or ""."""
    flag = os.environ.get(SKEW_ENV)
    try:
        return open(flag).read().strip() if flag else ""
    except FileNotFoundError:
        return ""


def _skewable_segment_forward() -> None:
    """The segment worker's two forwards with faults switched by `SKEW_ENV`'s file (above)."""
    import torch

    from kvtier.integration.sglang.blending import blend_worker

    real_prefill, real_segment = blend_worker.prefill, blend_worker.SegmentWorker._prefill

    def prefill(*args: Any, **kwargs: Any) -> Any:
        out = real_prefill(*args, **kwargs)
        if _skew() == "kvtier":
            out.kv[1, 3] *= 1.05
        return out

    @torch.inference_mode()
    def segment(self: Any, ids: Any) -> Any:
        kv = real_segment(self, ids)
        if _skew() == "records":
            kv[1, 2] *= 1.05
        return kv

    blend_worker.prefill = prefill  # type: ignore[assignment]
    blend_worker.SegmentWorker._prefill = segment  # type: ignore[method-assign]


def _register_mla_dispatch() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    def torch_native_mla(attn: Any, forward_batch: Any) -> AttnForwardMethod:
        return AttnForwardMethod.MLA

    AttentionBackendRegistry.register("torch_native", torch_native_mla)
