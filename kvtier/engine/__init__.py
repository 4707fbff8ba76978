"""The engine wing: what the serving-engine integrations call, and nothing else of kvtier.

Two doors here: `CacheEngine` (store and load KV by token prefix, from and into a connector's
pool) with its lower tiers at run time as `CacheEngine.tiers` (`TierControl`), and `PageStore`
(pages of a host pool stored by key: SGLang's HiCache L3 API). Both sit on the storage
manager. A third door is still outside the wing: blending's segments (`kvtier.blend.store`)
reach the storage manager through `CacheEngine.storage`, which is public for that, and
`verify` reads each tier's record below the manager's API.
"""

from __future__ import annotations

from kvtier.engine.cache import CacheEngine, Prefetch, TokenIds
from kvtier.engine.pages import PageStore
from kvtier.engine.tiers import TierControl
from kvtier.storage.backlog import WriteBacklog, WriteLoss

__all__ = ["CacheEngine", "PageStore", "Prefetch", "TierControl", "TokenIds", "WriteBacklog",
           "WriteLoss"]
