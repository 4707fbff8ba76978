"""The prefill speed a fresh server plans on before its own prefills are measured.

Loading a cached prefix saves the time its tokens take to compute, which for any model worth
caching is mostly its matrix products: about 2 x (weights a token passes through) FLOPs a
token. So the prior is the device's matrix-product rate, measured at start-up (milliseconds)
on a product as wide as the model's MLP in the pool's dtype, times `EFFICIENCY` (attention,
norms and launches), over those FLOPs: a large model on a GPU is costed at GPU speed and a
model on a CPU at CPU speed, instead of one constant that favours loading on the one and
recomputing on the other. The first prefill of 64 tokens or more replaces it
(`PrefillSpeed`).

A small model's prefill on a CPU is mostly fixed cost per step (Python, threads), which the
FLOP count does not see and the online estimate (tokens over the step's time) does: on a CPU
the prior is capped at `PRIOR_PREFILL_TOKENS_PER_S`, the speed measured for small models
there, so a small model's first requests load what its later ones will.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from kvtier.storage.prefetch.estimates import PRIOR_PREFILL_TOKENS_PER_S

__all__ = ["ModelShape", "prefill_prior", "matmul_flops", "EFFICIENCY"]

logger = logging.getLogger(__name__)

EFFICIENCY = 0.5  # the share of the matrix-product rate a whole prefill reaches (GPU MFU)
PROBE_ROWS = 512  # tokens a timed product stands for at most
PROBE_STEP_S = 0.005  # ... or fewer, once one product takes this long
MAX_PROBE_ELEMENTS = 1 << 22  # the weight matrix timed: 4M elements at most (8-16 MB)


class ModelShape(NamedTuple):
    """What the FLOPs of a token's pass depend on (a transformer's config.json)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> ModelShape | None:
        """From a Hugging Face config (Llama, Qwen and the like); None if a field is missing
        or not a positive number."""
        def num(key: str, default: object = None) -> int:
            value = config.get(key) or default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(key)
            return int(value)

        try:
            hidden, heads = num("hidden_size"), num("num_attention_heads")
            return cls(num("num_hidden_layers"), hidden, num("intermediate_size"), heads,
                       num("num_key_value_heads", heads), num("head_dim", hidden // heads))
        except ValueError:
            return None

    @property
    def flops_per_token(self) -> float:
        """2 x the weights of a layer's projections and gated MLP, over every layer."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return 2.0 * self.layers * (attn + mlp)


def prefill_prior(shape: ModelShape, device: torch.device, dtype: torch.dtype,
                  ) -> float | None:
    """Tokens per second the prefill of a model of `shape` reaches on `device` (see the
    module docstring); logs how it got there. None when the timed product fails (a dtype the
    device has no linear kernel for, no memory for it): an estimate never stops a launch."""
    try:
        rate = matmul_flops(shape.hidden, shape.intermediate, device, dtype)
    except RuntimeError as exc:
        logger.warning("kvtier: could not time a %s %s linear layer (%s); planning on %.0f "
                       "prefill tokens/s until the first measured prefill", device.type,
                       str(dtype).removeprefix("torch."), str(exc).splitlines()[0][:200],
                       PRIOR_PREFILL_TOKENS_PER_S)
        return None
    speed = rate * EFFICIENCY / shape.flops_per_token
    capped = device.type == "cpu" and speed > PRIOR_PREFILL_TOKENS_PER_S
    prior = PRIOR_PREFILL_TOKENS_PER_S if capped else speed
    logger.info("kvtier: prefill speed before the first measured prefill: %.0f tokens/s (%.3g "
                "GFLOP a token; %s %s linear layers at %.3g GFLOP/s%s)", prior,
                shape.flops_per_token / 1e9, device.type, str(dtype).removeprefix("torch."),
                rate / 1e9, f"; capped on a CPU from {speed:.0f}" if capped else "")
    return prior


def matmul_flops(hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype,
                 ) -> float:
    """FLOP/s of a linear layer `[rows, hidden] -> [rows, cols]` on `device` (best of 3), `cols` the
    MLP's width up to `MAX_PROBE_ELEMENTS // hidden`, `rows` doubled from 8 until one product
    takes `PROBE_STEP_S` (or `PROBE_ROWS`): milliseconds on any device, whatever the dtype.

    On a CPU the product runs on one thread, times the threads torch computes with: OpenMP
    threads that share their cores with a busy neighbour (another rank starting, a test)
    measured 1 GFLOP/s where one thread measured 73 on this project's 2-core host."""
    if device.type != "cpu":
        return _product_rate(hidden, intermediate, device, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return threads * _product_rate(hidden, intermediate, device, dtype)
    finally:
        torch.set_num_threads(threads)


def _product_rate(hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype,
                  ) -> float:
    cols = max(1, min(intermediate, MAX_PROBE_ELEMENTS // hidden))
    # A linear layer's own call (weights [out, in]): in bf16 on a CPU its kernel was 8x a
    # plain matmul's on this project's host, and models run linear layers.
    weight = torch.randn(cols, hidden, device=device).to(dtype)
    rows = 8
    while True:
        x = torch.randn(rows, hidden, device=device).to(dtype)
        took = _best_of(3, functools.partial(torch.nn.functional.linear, x, weight), device)
        if took >= PROBE_STEP_S or rows >= PROBE_ROWS:
            return 2.0 * rows * hidden * cols / max(took, 1e-9)
        rows *= 2


def _best_of(n: int, run: Callable[[], object], device: torch.device) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
