"""The anchor benchmarks' report: one row per arm and group of requests (a round, a phase),
each with its ratios to the `none` arm's same group measured in the same run, as a table, as
JSON and as a plot.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.anchors.driver import Record
from benchmarks.anchors.servers import NONE
from benchmarks.anchors.stats import Identity, Summary, format_table, ratio, write_plot

__all__ = ["Row", "build_rows", "format_rows", "row_json", "identity_json", "identity_line",
           "plot_rows", "tiers_line", "options_json", "COLUMNS", "TARGET_RATIO", "TARGET_HIT",
           "Target", "check_target", "request_json"]

TARGET_RATIO = 0.5  # a kvtier arm's later rounds at <= 0.5x no kvtier's median TTFT ...
TARGET_HIT = 0.5  # ... where its prefix is cached: at least half the prompt tokens hit


@dataclass(frozen=True)
class Row:
    """One arm's group of requests, and its ratios to the baseline's same group (NaN where
    the baseline has no such group)."""

    arm: str
    group: str
    summary: Summary
    mean_ratio: float
    median_ratio: float
    p99_ratio: float
    seconds_ratio: float


def build_rows(groups: Mapping[str, Mapping[str, Summary]], baseline: str = NONE) -> list[Row]:
    """`groups[arm][group]` (a `summarize` of its requests) -> rows, in the given order of
    arms and groups, each with its ratios to `groups[baseline][group]`."""
    base = groups.get(baseline, {})
    rows = []
    for arm, by_group in groups.items():
        for group, s in by_group.items():
            b = base.get(group)
            rows.append(Row(
                arm, group, s,
                ratio(s.ttft_mean_s, b.ttft_mean_s) if b else math.nan,
                ratio(s.ttft_median_s, b.ttft_median_s) if b else math.nan,
                ratio(s.ttft_p99_s, b.ttft_p99_s) if b else math.nan,
                ratio(s.seconds, b.seconds) if b else math.nan))
    return rows


def _ms(value: float) -> float:
    return value * 1e3


COLUMNS: dict[str, tuple[str, Callable[[Row], object]]] = {
    "arm": ("arm", lambda r: r.arm),
    "group": ("", lambda r: r.group),
    "requests": ("reqs", lambda r: r.summary.requests),
    "failed": ("failed", lambda r: r.summary.failed),
    "mean": ("mean TTFT ms", lambda r: _ms(r.summary.ttft_mean_s)),
    "median": ("median ms", lambda r: _ms(r.summary.ttft_median_s)),
    "p90": ("p90 ms", lambda r: _ms(r.summary.ttft_p90_s)),
    "p99": ("p99 ms", lambda r: _ms(r.summary.ttft_p99_s)),
    "seconds": ("round s", lambda r: r.summary.seconds),
    "input": ("in tok/s", lambda r: r.summary.input_tok_s),
    "output": ("out tok/s", lambda r: r.summary.output_tok_s),
    "hit": ("hit rate", lambda r: r.summary.hit_rate),
    "mean_ratio": ("mean/none", lambda r: r.mean_ratio),
    "median_ratio": ("median/none", lambda r: r.median_ratio),
    "p99_ratio": ("p99/none", lambda r: r.p99_ratio),
    "seconds_ratio": ("round/none", lambda r: r.seconds_ratio),
}


def format_rows(rows: Sequence[Row], columns: Sequence[str], group_header: str) -> str:
    """The table of `rows` with `columns` (keys of COLUMNS); the group column is headed
    `group_header`."""
    headers = [group_header if c == "group" else COLUMNS[c][0] for c in columns]
    return format_table(headers, [[COLUMNS[c][1](r) for c in columns] for r in rows])


def _finite(value: Any) -> Any:
    """JSON has no NaN: None instead (floats rounded for reading)."""
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    return value


def row_json(row: Row) -> dict[str, Any]:
    data = {"arm": row.arm, "group": row.group, **dataclasses.asdict(row.summary),
            "mean_ratio": row.mean_ratio, "median_ratio": row.median_ratio,
            "p99_ratio": row.p99_ratio, "seconds_ratio": row.seconds_ratio}
    return {k: _finite(v) for k, v in data.items()}


def identity_json(identity: Identity) -> dict[str, Any]:
    return {"identical": identity.identical, "compared": identity.compared,
            "differing": [list(k) if isinstance(k, tuple) else k for k in identity.differing]}


def identity_line(arm: str, identity: Identity | None) -> str:
    if identity is None:
        return f"  {arm}: not compared"
    if identity.identical:
        return f"  {arm}: yes ({identity.compared} requests)"
    return (f"  {arm}: NO, {len(identity.differing)} of {identity.compared} differ "
            f"(first: {identity.differing[:3]})")


def plot_rows(path: Path, title: str, rows: Sequence[Row]) -> str:
    """Median TTFT and hit rate per group (x) and arm (bars); see `write_plot`."""
    groups = list(dict.fromkeys(r.group for r in rows))
    arms = list(dict.fromkeys(r.arm for r in rows))
    by = {(r.arm, r.group): r.summary for r in rows}

    def series(get: Callable[[Summary], float]) -> dict[str, list[float]]:
        return {a: [get(by[(a, g)]) if (a, g) in by else math.nan for g in groups]
                for a in arms}

    return write_plot(path, title, groups, series(lambda s: s.ttft_median_s),
                      series(lambda s: s.hit_rate))


@dataclass(frozen=True)
class Target:
    """The rows the hit target covers: a kvtier arm's later rounds (`is_later`) that hit at
    least TARGET_HIT of their prompt tokens while the baseline's same group hit less (where
    the device cache hit as much, nothing can be 2x faster than it: those rows are
    `not_applicable`), and those of them above TARGET_RATIO x the baseline's median."""

    covered: list[Row]
    missed: list[Row]
    not_applicable: list[Row]

    def line(self) -> str:
        head = (f"target (kvtier's later rounds with hit rate >= {TARGET_HIT} where the "
                f"none arm's is lower: median TTFT <= {TARGET_RATIO}x none): ")
        if not self.covered:
            head += "no row to check"
        elif self.missed:
            head += "MISSED: " + ", ".join(f"{r.arm} {r.group} ({r.median_ratio:.2f}x)"
                                          for r in self.missed)
        else:
            head += f"met ({len(self.covered)} rows)"
        if self.not_applicable:
            head += "; not applicable (the device cache hit as much): " + ", ".join(
                f"{r.arm} {r.group}" for r in self.not_applicable)
        return head

    def json(self) -> dict[str, Any]:
        def names(rows: list[Row]) -> list[str]:
            return [f"{r.arm} {r.group}" for r in rows]
        return {"median_ratio_at_most": TARGET_RATIO, "hit_rate_at_least": TARGET_HIT,
                "covered": names(self.covered), "missed": names(self.missed),
                "not_applicable": names(self.not_applicable)}


def check_target(rows: Sequence[Row], is_later: Callable[[Row], bool]) -> Target:
    base = {r.group: r.summary.hit_rate for r in rows if r.arm == NONE}
    hits = [r for r in rows if r.arm != NONE and is_later(r)
            and r.summary.hit_rate >= TARGET_HIT]
    covered = [r for r in hits if not base.get(r.group, 0.0) >= TARGET_HIT]
    return Target(covered, [r for r in covered if not r.median_ratio <= TARGET_RATIO],
                  [r for r in hits if r not in covered])


def options_json(opts: Any) -> Any:
    """A dataclass of options as JSON: paths as strings, an infinite rate as "inf"."""
    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    return clean(dataclasses.asdict(opts))


def tiers_line(arm: str, counters: Mapping[str, float]) -> str:
    """`arm`'s kvtier hits per tier (chunks) and dropped writes, from its counters."""
    def per_tier(metric: str) -> str:
        found = {k.split('tier="')[1].split('"')[0]: int(v) for k, v in counters.items()
                 if k.startswith(metric + "{") and 'tier="' in k}
        return ", ".join(f"{t} {n}" for t, n in sorted(found.items())) or "none"

    return (f"  {arm}: chunks hit per tier: {per_tier('kvtier_hit_chunks_total')}; writes "
            f"dropped: {per_tier('kvtier_write_dropped_total')}")


def request_json(rec: Record) -> dict[str, Any]:
    """One request for the results file (its output's length, not its ids)."""
    return {"client": rec.client, "round": rec.round, "start_s": round(rec.start_s, 4),
            "ttft_s": _finite(rec.ttft_s), "end_s": round(rec.end_s, 4),
            "prompt_tokens": rec.prompt_tokens, "cached_tokens": rec.cached_tokens,
            "output_tokens": len(rec.output_ids), "error": rec.error}
