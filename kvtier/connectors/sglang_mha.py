"""SGLang MHA/GQA pools: per-layer K and V buffers of shape `[slots, kv_heads, head_dim]`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.connectors.base import KVConnector, check_layer_buffers
from kvtier.kernels import ops
from kvtier.memory import KVLayout, MemoryObj

__all__ = ["SGLangMHAConnector"]


class SGLangMHAConnector(KVConnector):
    """Chunks as `KV_2LTD` objects: `[2, layers, tokens, heads * head_dim]`, K then V."""

    def __init__(self, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]):
        k = check_layer_buffers(k_buffers, "k_buffers")
        v = check_layer_buffers(v_buffers, "v_buffers")
        if len(k) != len(v):
            raise ValueError(f"k_buffers has {len(k)} layers, v_buffers has {len(v)}")
        if v_buffers[0].shape != k_buffers[0].shape or v[0].dtype != k[0].dtype or \
                v[0].device != k[0].device:
            raise ValueError(
                f"v_buffers[0] is {tuple(v_buffers[0].shape)} {v[0].dtype} on {v[0].device}, "
                f"k_buffers[0] is {tuple(k_buffers[0].shape)} {k[0].dtype} on {k[0].device}: "
                "kvtier stores K and V as one [2, layers, tokens, hidden] object, so they must "
                "have the same shape (models with a different V head dim are not supported)")
        _, heads, head_dim = k_buffers[0].shape
        self.layout = KVLayout.mha(len(k), heads, head_dim, k[0].dtype)
        self.num_slots = k[0].shape[0]
        self.device = k[0].device
        self._layers = ops.CheckedLayers(k + v)  # one kernel call: K and V of every layer

    def gather(self, slots: torch.Tensor, out: MemoryObj) -> None:
        self.check_obj(out, slots, name="out")
        t = out.tensor
        ops.gather(self._layers, slots, t.view(2 * t.shape[1], t.shape[2], t.shape[3]))

    def scatter(self, obj: MemoryObj, slots: torch.Tensor) -> None:
        self.check_obj(obj, slots, name="obj")
        t = obj.tensor
        ops.scatter(t.view(2 * t.shape[1], t.shape[2], t.shape[3]), slots, self._layers)
