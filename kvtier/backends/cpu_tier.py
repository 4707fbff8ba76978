"""The CPU tier the tier table builds: the implementation of `eviction_policy`, looked up in
one table (a policy is a `CPUBackend` subclass and a row here)."""

from __future__ import annotations

from kvtier.backends.base import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.backends.cpu_arc import ARCBackend
from kvtier.backends.cpu_lfuda import LFUDABackend
from kvtier.config.names import ARC, EVICTION_POLICIES, LFUDA, LRU
from kvtier.errors import ConfigError

__all__ = ["CPUTier", "EVICTION"]

EVICTION: dict[str, type[CPUBackend]] = {LRU: CPUBackend, ARC: ARCBackend,
                                          LFUDA: LFUDABackend}
assert set(EVICTION) == set(EVICTION_POLICIES), "kvtier.config.names lists other policies"


class CPUTier(CPUBackend):
    """The tier table's CPU tier: `CPUTier(ctx)` is the `CPUBackend` (or subclass) of
    `ctx.config.eviction_policy`; `ConfigError` listing the valid names if unknown."""

    def __new__(cls, ctx: BackendContext, *, name: str | None = None) -> CPUBackend:  # type: ignore[misc]
        policy = ctx.config.eviction_policy
        if policy not in EVICTION:
            raise ConfigError(f"eviction_policy: must be one of {list(EVICTION)}, got {policy!r}")
        return EVICTION[policy](ctx, name=name)
