"""Connectors between serving engines' paged KV pools and kvtier memory objects.

One class per pool layout (`sglang_mha`, `sglang_mla`) behind `base.KVConnector`; beside them
what a pool's copies need on a device: `staging` (GPU buffers and the copy path), `streams`
(kvtier's CUDA streams and the fence that releases a load's objects) and `hugepages` (host
memory for pinned arenas). The copies themselves are the kernels' (`kvtier.kernels`).
"""

from __future__ import annotations

from kvtier.connectors.base import KVConnector
from kvtier.connectors.sglang_mha import SGLangMHAConnector
from kvtier.connectors.sglang_mla import SGLangMLAConnector

__all__ = ["KVConnector", "SGLangMHAConnector", "SGLangMLAConnector"]
