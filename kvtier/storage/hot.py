"""The CPU tier and its arena, as the storage manager opens them."""

from __future__ import annotations

from kvtier.backends import BackendContext, HotTier, create_backend
from kvtier.backends.cpu import CPUBackend
from kvtier.config import Config
from kvtier.config.host import arena_now_problem, memory_problem
from kvtier.config.names import CPU
from kvtier.errors import ConfigError
from kvtier.memory import MemoryAllocator
from kvtier.metrics import RateLimitedLog
from kvtier.storage.guard import STAGING, GuardedHotTier, StagingTier

__all__ = ["new_arena", "open_hot_tier"]


def new_arena(config: Config) -> MemoryAllocator:
    """An arena of `max_local_cpu_size` GB; `ConfigError` if this host cannot hold it."""
    # A config may be sized for a bigger host (check-config only warns): refuse here, naming
    # the key, before a too-large arena is allocated and faulted in.
    # Then against what is free now: a serving engine allocates its own pool first.
    problem = memory_problem(config) or arena_now_problem(config)
    if problem:
        raise ConfigError(problem)
    return MemoryAllocator(int(config.max_local_cpu_size * 1e9))


def open_hot_tier(ctx: BackendContext, warn: RateLimitedLog) -> HotTier:
    """The CPU tier behind its failure guard; with `local_cpu: false`, a CPU tier that only
    stages loads (`StagingTier`), so lower tiers are read in the background in every
    configuration and no code path needs to ask whether there is a CPU tier."""
    if not ctx.config.local_cpu:
        return StagingTier(CPUBackend(ctx, name=STAGING), ctx.counters, warn)
    cpu = create_backend(CPU, ctx)
    assert isinstance(cpu, HotTier), cpu
    return GuardedHotTier(cpu, ctx.counters, warn)
