"""Typed views of the flat config (the YAML stays flat, as LMCache's): each part of kvtier
takes the section it reads (`Config.prefetch`, `.writes`, `.blend`), not the whole `Config`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlendSection", "PrefetchSection", "WriteSection"]


@dataclass(frozen=True)
class PrefetchSection:
    """What the prefetch policies read (`Config.prefetch`)."""

    policy: str
    timeout_base_ms: float
    timeout_per_token_ms: float
    wait_complete_max_ms: float


@dataclass(frozen=True)
class WriteSection:
    """What the write policies read (`Config.writes`)."""

    policy: str
    selective_threshold: int


@dataclass(frozen=True)
class BlendSection:
    """What blending reads (`Config.blend`): on or off, the separator text, the check layers
    and the share of cached tokens recomputed at each, the shortest segment worth loading,
    how fast a blend must be against the full prefill to be chosen, and whether SGLang's
    forward computes the recomputed tokens past the check layers."""

    enabled: bool
    separator: str
    check_layers: tuple[int, ...]
    ratios: tuple[float, ...]
    min_tokens: int
    max_prefill_ratio: float = 1.0
    in_forward: bool = True
