"""The serving engine's prefill speed, as the engine wing shows it to the integrations.

Fed by the engine's own prefill batches (`observe`), read wherever kvtier weighs a load or a
blend against computing the same tokens (`recompute_s`): the adaptive load planner (below, in
the storage manager) and blending's planner (`kvtier.blend.planner`, through the SGLang
integration). Until a prefill is measured, the speed is the prior `plan_from` derives from the
model's shape.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvtier.storage.prefetch.estimates import PrefillSpeed
from kvtier.storage.prefetch.prefill_prior import ModelShape, prefill_prior

__all__ = ["EnginePrefill"]


class EnginePrefill:
    """`CacheEngine.prefill`: the measured speed (`speed`, the storage manager's) of an engine
    whose KV pool is on `device` in `dtype`. Thread-safe (the speed is)."""

    def __init__(self, speed: PrefillSpeed, device: torch.device, dtype: torch.dtype):
        self._speed = speed
        self._device, self._dtype = device, dtype

    def observe(self, tokens: int, seconds: float, prompt_len: int) -> None:
        """The serving engine computed `tokens` new tokens of prompts up to `prompt_len` long
        in `seconds`."""
        self._speed.observe(tokens, seconds, prompt_len)

    def recompute_s(self, tokens: int, prompt_len: int) -> float:
        """How long the serving engine is expected to take to prefill `tokens` new tokens of
        a prompt `prompt_len` long."""
        return self._speed.recompute_s(tokens, prompt_len)

    def plan_from(self, model_config: Mapping[str, object]) -> None:
        """Until a prefill is measured, plan on the speed `prefill_prior` derives from the
        model `model_config` (its config.json) describes, on the pool's device (if it can
        read it)."""
        shape = ModelShape.from_config(model_config)
        prior = None if shape is None else prefill_prior(shape, self._device, self._dtype)
        if prior is not None:
            self._speed.set_prior(prior)
