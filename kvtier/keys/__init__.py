"""Chunk keys: what a chunk is stored under, in every process and on every machine.

`chunks.py` cuts token sequences into chunks and chains their digests (`KeyBuilder`,
`KeyChain`, `ChunkKey`, `KeySpace`); `names.py` holds the key strings' components (version,
model component, tenant tags) and the Redis names of a record. Every name is importable from
`kvtier.keys` itself.
"""

from __future__ import annotations

from kvtier.config.names import NAMESPACE_PATTERN
from kvtier.kernels.tokens import encode_tokens
from kvtier.keys.chunks import ChunkKey, KeyBuilder, KeyChain, KeySpace, TokenIds, stub_key
from kvtier.keys.names import (
    ALL_KEYS,
    KEY_VERSION,
    TAG_PREFIX,
    key_of_redis_name,
    model_component,
    model_name_of,
    redis_names,
    tag_of_key,
    tenant_tag,
)

__all__ = ["ChunkKey", "KeyBuilder", "KeyChain", "KeySpace", "encode_tokens", "stub_key",
           "redis_names", "key_of_redis_name", "KEY_VERSION", "ALL_KEYS", "model_component",
           "model_name_of", "NAMESPACE_PATTERN", "TAG_PREFIX", "tenant_tag", "tag_of_key",
           "TokenIds"]
