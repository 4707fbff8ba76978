"""What the fleet benchmark's pieces share: its options and what a run (and the failover)
measured; `runs` runs them, `report` shows them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.serving.shared import RunResult

POLICIES = ("round_robin", "cache_aware")


@dataclass
class Options:
    router: str = "smg"  # or "sglang-router", the legacy one (benchmarks/fleet/gateway.py)
    servers: int = 3
    num_groups: int = 8
    prompts_per_group: int = 4
    system_prompt_len: int = 1024
    question_len: int = 64
    output_len: int = 8
    max_concurrency: int = 4
    max_total_tokens: int = 3000
    single_total_tokens: int = 100_000  # the reference server's pool: the whole workload
    hidden: int = 512
    layers: int = 8
    threads: int = 1  # OMP threads per server (the fleet shares this machine's cores)
    policies: tuple[str, ...] = POLICIES
    failover: bool = True
    probes: int = 40
    probe_len: int = 1024
    kill_after_s: float = 4.0
    node_timeout_ms: int = 2000
    work_dir: Path | None = None


@dataclass
class Failover:
    """What the master failover did (times in seconds from the kill)."""

    victim_port: int = 0
    victim_records: int = 0
    lost_records: int = 0
    promoted_s: float | None = None
    resumed_s: float | None = None  # from the promotion
    probes: list[dict[str, Any]] = field(default_factory=list)
    failed_probes: int = 0


@dataclass
class FleetRun:
    name: str
    policy: str
    servers: int
    kvtier: bool
    client: RunResult
    cached_fraction: float | None = None
    tier_counters: dict[str, float] = field(default_factory=dict)  # "redis.puts": sum over servers
    failover: Failover | None = None
