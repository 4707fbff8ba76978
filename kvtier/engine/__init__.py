"""The engine wing: what the serving-engine integrations call of kvtier's storage.

Two doors: `CacheEngine` (`cache`: store and load KV by token prefix, from and into a
connector's pool), with its lower tiers at run time as `CacheEngine.tiers` (`TierControl`) and
blending's segments as `CacheEngine.segments` (a `kvtier.engine.segments.SegmentStore` the engine
builds over its storage manager); and `PageStore` (`pages`: pages of a host pool stored by key,
SGLang's HiCache L3 API). Both sit on the storage manager, which is the engine's own
(`CacheEngine.storage` is a deprecated shim for one release); nothing in kvtier reads it
(tests/test_architecture.py).

Behind the doors: `saving` (a store's chunks from the pool into the CPU tier), `rows` (which
pool rows a load writes), `around` (write-around: chunks the CPU tier's admission refused still
reach the lower tiers), `prefill` (the serving engine's measured prefill speed), `verify`
(shadow verification of a sampled request's KV against every tier's records) and `tenants`
(one tenant forgotten by a running engine). `WriteBacklog` and `WriteLoss` are re-exported
from the storage manager's write backlog for the integrations' stop reports.
"""

from __future__ import annotations

from kvtier.engine.cache import CacheEngine, Prefetch, TokenIds
from kvtier.engine.pages import PageStore
from kvtier.engine.prefix import Prefix
from kvtier.engine.tiers import TierControl
from kvtier.storage.backlog import WriteBacklog, WriteLoss

__all__ = ["CacheEngine", "PageStore", "Prefetch", "Prefix", "TierControl", "TokenIds",
           "WriteBacklog", "WriteLoss"]
