"""What the anchor benchmarks report: TTFT statistics, throughput and hit rate of a group of
requests, ratios to the no-kvtier arm of the same run, output identity, tables and a plot.

Percentiles are numpy's (linear interpolation), as SGLang's own benchmark client computes
them. The hit rate of a group is the sum of SGLang's `meta_info.cached_tokens` over the sum of
its prompt tokens. Failed requests count in `failed` and nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from benchmarks.anchors.driver import Record

K = TypeVar("K", bound=Hashable)

__all__ = ["Summary", "summarize", "summarize_blocks", "ratio", "Identity", "compare_outputs",
           "format_table", "write_plot"]


@dataclass(frozen=True)
class Summary:
    """A group of requests (a round, a phase). `seconds`: first send to last answer."""

    requests: int
    failed: int
    ttft_mean_s: float
    ttft_median_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    seconds: float
    input_tok_s: float
    output_tok_s: float
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float


def summarize(records: Sequence[Record]) -> Summary:
    """Statistics of `records`; TTFT and tokens over the requests that answered (NaN where
    none did)."""
    ok = [r for r in records if not r.error]
    ttft = [r.ttft_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out = sum(len(r.output_ids) for r in ok)
    span = (max(r.end_s for r in records) - min(r.start_s for r in records)) if records \
        else math.nan

    def pct(q: float) -> float:
        return float(np.percentile(ttft, q)) if ttft else math.nan

    return Summary(
        requests=len(records), failed=len(records) - len(ok),
        ttft_mean_s=float(np.mean(ttft)) if ttft else math.nan,
        ttft_median_s=pct(50), ttft_p90_s=pct(90), ttft_p99_s=pct(99), seconds=span,
        input_tok_s=prompt / span if span > 0 else math.nan,
        output_tok_s=out / span if span > 0 else math.nan,
        prompt_tokens=prompt, cached_tokens=cached,
        hit_rate=cached / prompt if prompt else math.nan)


def summarize_blocks(blocks: Sequence[Sequence[Record]]) -> Summary:
    """`summarize` over every request of `blocks` run one after another with pauses between
    them: `seconds` is the sum of the blocks' spans (not first send to last answer), and the
    token rates are over that sum."""
    pooled = summarize([r for block in blocks for r in block])
    spans = [summarize(block).seconds for block in blocks if block]
    seconds = sum(spans) if spans else math.nan
    ok = [r for block in blocks for r in block if not r.error]
    return dataclasses.replace(
        pooled, seconds=seconds,
        input_tok_s=pooled.prompt_tokens / seconds if seconds > 0 else math.nan,
        output_tok_s=sum(len(r.output_ids) for r in ok) / seconds if seconds > 0 else math.nan)


def ratio(value: float, baseline: float) -> float:
    """`value / baseline`, NaN when either is missing or the baseline is not positive."""
    if not (math.isfinite(value) and math.isfinite(baseline)) or baseline <= 0:
        return math.nan
    return value / baseline


@dataclass(frozen=True)
class Identity:
    """Outputs compared request by request with the reference (the no-kvtier arm)."""

    compared: int
    differing: list[Any] = field(default_factory=list)  # keys of the requests that differ

    @property
    def identical(self) -> bool:
        return self.compared > 0 and not self.differing


def compare_outputs(reference: Mapping[K, list[int]], got: Mapping[K, list[int]]) -> Identity:
    """Compare every request in `got` with the reference output of the same key; a key the
    reference lacks, or an empty output (a failed request), counts as differing."""
    differing = [key for key, ids in got.items()
                 if not ids or reference.get(key) != ids]
    return Identity(len(got), differing)


def _cell(value: object) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        return f"{value:.2f}" if abs(value) >= 10 else f"{value:.3f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: strings left-aligned, numbers right-aligned, NaN as "-"."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [all(not isinstance(row[i], str) for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def write_plot(path: Path, title: str, groups: Sequence[str],
               median_s: Mapping[str, Sequence[float]],
               hit_rate: Mapping[str, Sequence[float]]) -> str:
    """Grouped bars (one group per round or phase, one bar per arm): median TTFT above, hit
    rate below, into `path`. Returns a note for the user: what was written, or why not
    (matplotlib is optional: `pip install 'kvtier[demo]'`)."""
    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'kvtier[demo]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(median_s)
    width = 0.8 / max(1, len(arms))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7.0, 1.2 * len(groups) + 3), 6.4),
                                      dpi=110, sharex=True)
    for i, arm in enumerate(arms):
        xs = [g + (i - (len(arms) - 1) / 2) * width for g in range(len(groups))]
        top.bar(xs, [_zero(v) for v in median_s[arm]], width, label=arm)
        bottom.bar(xs, [_zero(v) for v in hit_rate[arm]], width, label=arm)
    top.set_ylabel("median TTFT (s)")
    bottom.set_ylabel("hit rate (cached / prompt tokens)")
    bottom.set_ylim(0, 1.05)
    bottom.set_xticks(range(len(groups)), list(groups), fontsize=8)
    top.set_title(title, fontsize=9)
    # Upper left of the hit-rate panel: the first round or phase (nothing cached yet) is empty.
    bottom.legend(fontsize=8, loc="upper left")
    for ax in (top, bottom):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return f"wrote {path}"


def _zero(value: float) -> float:
    return value if math.isfinite(value) else 0.0
