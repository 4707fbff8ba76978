"""Connectors between serving engines' paged KV pools and kvtier memory objects."""

from __future__ import annotations

from kvtier.connectors.base import KVConnector
from kvtier.connectors.sglang_mha import SGLangMHAConnector
from kvtier.connectors.sglang_mla import SGLangMLAConnector

__all__ = ["KVConnector", "SGLangMHAConnector", "SGLangMLAConnector"]
