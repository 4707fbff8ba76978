"""What the serving benchmark's pieces share: its phases, its options, one run's result.

`bench_serving.py` runs the phases (`runs`); `report` and `timeline`
read what they measured. This module imports none of them: no import cycle among them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("none", "first", "first-again", "second", "second-verify", "noreuse-none",
          "noreuse-kv", "noreuse-pair", "null-pair")
# `noreuse-pair` runs as two results, `pair-none` and `pair-kv`, `null-pair` as `null-a` and
# `null-b` (see `Bench.run_pair`).
PAIRS = {"noreuse-pair": ("pair-none", "pair-kv"), "null-pair": ("null-a", "null-b")}
KVTIER_PHASES = frozenset({"first", "first-again", "second", "second-verify", "noreuse-kv",
                           "pair-kv"})
# Phases served from what `first-again` left in Redis and on disk.
SECOND_PHASES = frozenset({"second", "second-verify"})
NOREUSE_PHASES = frozenset({"noreuse-none", "noreuse-kv", "pair-none", "pair-kv", "null-a",
                            "null-b"})


@dataclass
class Options:
    """What one invocation runs (see `--help`)."""

    runs: int = 1
    system_prompt_lens: tuple[int, ...] = (1024, 1600)
    num_groups: int = 4
    prompts_per_group: int = 4
    question_len: int = 64
    output_len: int = 8
    max_concurrency: int = 2
    max_total_tokens: int = 3000
    hidden: int = 512
    layers: int = 8
    phases: tuple[str, ...] = PHASES
    warmup_requests: int = 1
    tokenize_prompt: bool = False
    threads: int = 0  # OMP threads per server; 0: every core
    disk_gb: float = 4.0
    lower_tiers: tuple[str, ...] = ("disk", "redis")  # kvtier's tiers below the CPU tier
    work_dir: Path | None = None
    # The client's seed for the no-reuse prompts. `random-ids` prompts are runs of consecutive
    # token ids from a random start in the 512-token vocabulary, so two can share a prefix once
    # the server re-tokenizes their text: at the client's default seed (42) two of the 16 share
    # 2659 of ~2670 tokens, a free hit for kvtier; at 2, two share 72 tokens, which SGLang's
    # device cache kept in one run and not the other (an extend is slower than a prefill on
    # CPU). At 43 no two share more than 9 tokens, at both default lengths.
    noreuse_seed: int = 43
    timeline: bool = False  # also sample kvtier's lower-tier writes every second
    verify_fraction: float = 0.01  # `second-verify`'s share of requests verified


@dataclass
class RunResult:
    """One client run against one fresh server."""

    phase: str
    system_prompt_len: int
    rep: int
    kvtier: bool
    dataset: str
    repeat: int = 1  # this phase's how-many-th run in its set (`--phases` may name one twice)
    core: int | None = None  # the one core the server ran on (`noreuse-pair`)
    start_s: float = 0.0
    requests: int = 0
    completed: int = 0
    client_completed: int = 0  # what the client counted (it may count errors as successes)
    failed: int = 0
    duration_s: float | None = None
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    request_throughput: float | None = None
    input_tokens: int | None = None
    cached_tokens: int | None = None
    kernel_compile_s: float | None = None
    log_loaded_tokens: int | None = None
    counters: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    client_rc: int = 0
    # CPU seconds by thread name over the client's run (`thread_cpu`; kvtier runs include the
    # Redis server's): what each side spent, host noise (other processes' CPU) left out.
    cpu_s: dict[str, float] = field(default_factory=dict)
    # The same in groups, sampled every second (`timeline`), and what each group spent
    # inside the client's measured window alone ("writes": kvtier's lower-tier writes, with
    # `--timeline`).
    timeline: list[list[float]] = field(default_factory=list)
    in_run: dict[str, float] | None = None
    # The model forwards inside that window (`timeline.forward_totals`).
    forward: dict[str, float] | None = None
