"""SGLang MLA pools: per-layer latent buffers of shape `[slots, 1, kv_lora_rank + rope_dim]`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.connectors.base import KVConnector, check_layer_buffers
from kvtier.kernels import ops
from kvtier.memory import KVLayout, MemoryObj

__all__ = ["SGLangMLAConnector"]


class SGLangMLAConnector(KVConnector):
    """Chunks as `KV_MLA` objects: `[1, layers, tokens, kv_dim]`."""

    def __init__(self, kv_buffers: Sequence[torch.Tensor]):
        flat = check_layer_buffers(kv_buffers, "kv_buffers")
        if kv_buffers[0].shape[1] != 1:
            raise ValueError(f"kv_buffers[0] must be [slots, 1, kv_dim] for MLA, got "
                             f"{tuple(kv_buffers[0].shape)}")
        self.layout = KVLayout.mla(len(flat), flat[0].shape[1], flat[0].dtype)
        self.num_slots = flat[0].shape[0]
        self.device = flat[0].device
        self._layers = ops.CheckedLayers(flat)

    def gather(self, slots: torch.Tensor, out: MemoryObj) -> None:
        self.check_obj(out, slots, name="out")
        ops.gather(self._layers, slots, out.tensor[0])

    def scatter(self, obj: MemoryObj, slots: torch.Tensor) -> None:
        self.check_obj(obj, slots, name="obj")
        ops.scatter(obj.tensor[0], slots, self._layers)
