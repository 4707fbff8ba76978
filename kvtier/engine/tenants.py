"""One tenant forgotten by a running engine (issue 71, item 3): `forget_tenant`.

A tenant is a request's salt (SGLang's `cache_salt`), which every `ChunkKey` of its chains
carries. The CPU tier (or the staging tier of `local_cpu: false`) lives in the serving process,
so only the engine can forget what it holds there; `kvtier purge --tenant` reaches the disk and
Redis records from a config, and with `--server` asks each server for this through its admin
route (`kvtier.integration.sglang.admin.routes`).

What goes: every chunk the tenant holds in the CPU tier, from every tier the engine holds (the
same keys in the disk and Redis tiers too, so the engine's own disk index learns of it and the
tier watchers are told). What stays: every other tenant's chunks, and unsalted chunks (no
tenant; never matched by a salt). Not reached here: a lower tier's records of the tenant the CPU
tier no longer holds (the CLI's inventory purge deletes those), a write the tier writers queued
before the purge and write after it (purge once the tenant's traffic stopped, or purge again),
and SGLang's own device tree (its pages go as SGLang evicts them, or with `/flush_cache`).

The salt itself is never logged nor reported: answers and logs name the tenant by its keyed
tag (`kvtier.keys.tenant_tag`), the one its records' key names carry.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtier.keys import TAG_PREFIX, tenant_tag
from kvtier.keys.record_keys import name_salt

if TYPE_CHECKING:
    from kvtier.engine.cache import CacheEngine

__all__ = ["forget_tenant", "tag_of_tenant"]

logger = logging.getLogger(__name__)


def tag_of_tenant(engine: CacheEngine, salt: str) -> str:
    """The keyed tag of tenant `salt` in this engine's key names (16 hex digits).

    Raises:
        ValueError: naming `tenant` for an empty salt (unsalted chunks belong to no tenant)
            or one that is not text.
    """
    if not isinstance(salt, str) or not salt:
        raise ValueError("tenant: give the tenant's salt (a request's cache_salt); chunks "
                         "without one belong to no tenant")
    config = engine.config
    try:
        return tenant_tag(name_salt(config.hash_salt, config.record_key_file), salt)
    except ValueError as exc:
        raise ValueError(f"tenant: {exc}") from None


def forget_tenant(engine: CacheEngine, salt: str) -> dict[str, int]:
    """Delete every chunk tenant `salt` holds in the engine's CPU tier from every tier the
    engine holds; `{tier name: chunks deleted there}` for every attached tier, fastest first.

    A lower tier's count is of those same keys (see the module's note on what is not reached).
    Raises ValueError as `tag_of_tenant`; a tier that fails counts 0 (its guard logs it)."""
    tag = tag_of_tenant(engine, salt)
    keys = engine.tiers.tenant_chunks(salt)
    # every tier, slowest first (`TierControl.remove`), and their watchers told
    counts = engine.tiers.remove(keys) if keys else dict.fromkeys(engine.tiers.names, 0)
    logger.info("kvtier: tenant %s%s forgotten: %s", TAG_PREFIX, tag,
                ", ".join(f"{n} {t}" for t, n in counts.items()))
    return counts
