"""The demo's output: one line per measured turn, a summary, JSON, and a PNG plot."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.config.names import CPU, DISK, REDIS
from kvtier.demo.quiet import BUSY_CORES, busy

__all__ = ["summarize", "format_row", "format_summary", "write_results", "HEADER",
           "format_host_start", "format_host"]

HEADER = (f"{'phase':<16} {'conv':>4} {'turn':>4} {'prompt':>7} {'without':>9} {'with':>9} "
          f"{'ratio':>6}  {'hit tokens (tier)':<20} {'prev turn':>9} identical")
_COLORS = {CPU: "#2a9d8f", DISK: "#e9c46a", REDIS: "#e76f51", "none": "#3d5a80"}


def summarize(rows: Sequence[dict[str, Any]], system_prompt_tokens: int) -> dict[str, Any]:
    """Medians per phase, and the headline: requests whose cached prefix covers at least the
    system prompt (TTFT with kvtier over TTFT without)."""
    def medians(subset: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if not subset:
            return {"requests": 0}
        return {"requests": len(subset),
                "ttft_without_s": round(statistics.median(r["ttft_without_s"] for r in subset), 4),
                "ttft_with_s": round(statistics.median(r["ttft_with_s"] for r in subset), 4),
                "ratio": round(statistics.median(r["ratio"] for r in subset), 4),
                "hit_tokens": int(statistics.median(r["hit_tokens"] for r in subset))}

    phases = {phase: medians([r for r in rows if r["phase"] == phase])
              for phase in dict.fromkeys(r["phase"] for r in rows)}
    long_hits = [r for r in rows if r["hit_tokens"] >= system_prompt_tokens]
    tiers: dict[str, int] = {}
    for r in rows:
        for tier, n in r["hit_tokens_per_tier"].items():
            tiers[tier] = tiers.get(tier, 0) + n
    return {"all_identical": all(r["identical"] for r in rows), "phases": phases,
            "hit_tokens_per_tier": tiers,
            "headline": {"cached_prefix_at_least": system_prompt_tokens, **medians(long_hits)}}


def format_row(row: dict[str, Any]) -> str:
    hit = f"{row['hit_tokens']} ({row['tier']})"
    ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}x"
    prev = row.get("previous_turn_tokens")
    return (f"{row['phase']:<16} {row['conversation']:>4} {row['turn']:>4} "
            f"{row['prompt_tokens']:>7} {row['ttft_without_s']:>8.3f}s {row['ttft_with_s']:>8.3f}s "
            f"{ratio:>6}  {hit:<20} {'-' if prev is None else prev:>9} "
            f"{'yes' if row['identical'] else 'NO'}")


def format_summary(results: dict[str, Any]) -> str:
    s = results["summary"]
    lines = []
    head = s["headline"]
    if head["requests"]:
        lines.append(
            f"TTFT for a cached prefix of >= {head['cached_prefix_at_least']} tokens "
            f"(median of {head['requests']}): {head['ttft_with_s']:.3f}s with kvtier, "
            f"{head['ttft_without_s']:.3f}s without ({head['ratio']:.2f}x)")
    for phase, m in s["phases"].items():
        if m["requests"]:
            lines.append(f"  {phase:<16} median TTFT {m['ttft_with_s']:.3f}s vs "
                         f"{m['ttft_without_s']:.3f}s ({m['ratio']:.2f}x), "
                         f"median hit {m['hit_tokens']} tokens")
    tiers = ", ".join(f"{t} {n}" for t, n in s["hit_tokens_per_tier"].items()) or "none"
    lines.append(f"hit tokens per tier: {tiers}")
    lines.append("outputs identical to the baseline: "
                 + ("yes, every request" if s["all_identical"] else "NO (see rows)"))
    lines += format_host(results["host"]) if "host" in results else []
    if sample := results.get("sample"):
        lines.append(f"conversation {sample['conversation']}, last turn: "
                     f"{sample['question'].splitlines()[-2:]!r} -> {sample['answer']!r}")
    return "\n".join(lines)


def _cores(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def _busy_note(used: dict[str, Any], cores: int, when: str) -> list[str]:
    if not busy(used):
        return []
    steal = used.get("steal_cores") or 0.0
    took = f"other processes {_cores(used['other_cores'])}" + (
        f" (and the hypervisor {steal:.2f})" if steal else "")
    return [f"note: {took} of {cores} cores {when} (>= {BUSY_CORES}): every TTFT is slower "
            f"and the ratios noisier than on a quiet host; for a quiet run, stop other jobs "
            f"(`top` shows them) or run the demo on a host of its own"]


def format_host_start(cores: int, start: dict[str, Any]) -> list[str]:
    """The lines printed before the servers start: the host's load, that the servers share
    its cores and how the demo keeps them apart, and a note if others are busy."""
    load = " ".join(map(str, start["load_average"] or ())) or "?"
    return [f"host: {cores} cores, load average {load}, other processes using "
            f"{_cores(start['other_cores'])} cores (over {start['window_s']:.1f} s)",
            "the baseline and kvtier servers share these cores: they measure one request at a "
            "time, and each baseline request waits for the kvtier server's background writes "
            "(disk, Redis) to finish first",
            *_busy_note(start, cores, "before the servers started")]


def format_host(host: dict[str, Any]) -> list[str]:
    """The summary's lines on the host during the measured requests."""
    m, w, cores = host["measured"], host["write_waits"], host["cores"]
    load = m["load_average_first"][0] if m["load_average_first"] else "?"
    lines = [f"host during the measured requests ({m['window_s']:.0f} s): other processes "
             f"{_cores(m['other_cores'])} cores, the demo's own {_cores(m['own_cores'])}, of "
             f"{cores}; load average {load} at the first, {m['load_average_peak']} at most",
             f"waits for the kvtier server's writes before the baseline's requests: "
             f"{w['waits']}, {w['total_s']:.1f} s in all (longest {w['max_s']:.1f} s), "
             f"{w['timed_out']} ran out of time"
             + (f", {w['no_gauge']} without its metrics (the flush alone waited)"
                if w["no_gauge"] else "")]
    return lines + _busy_note(m, cores, "during the measured requests")


def write_results(results: dict[str, Any], out_dir: Path) -> list[str]:
    """Write `demo.json` and, when matplotlib is installed, `demo.png` into `out_dir`;
    returns notes for the user (what was written, or why the plot was not)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "demo.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    notes = [f"wrote {path}"]
    try:
        import matplotlib
    except ImportError:
        notes.append("no plot: matplotlib is not installed (pip install 'kvtier[demo]')")
        return notes
    matplotlib.use("Agg")
    png = out_dir / "demo.png"
    plot(results, png)
    notes.append(f"wrote {png}")
    return notes


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = results["rows"]
    labels = [f"{_short(r['phase'])}\nc{r['conversation']} t{r['turn']}" for r in rows]
    x = range(len(rows))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(7.0, 0.75 * len(rows) + 2), 4.8), dpi=120)
    ax.bar([i - width / 2 for i in x], [r["ttft_without_s"] for r in rows], width,
           color="#adb5bd", label="without kvtier (recompute)")
    ax.bar([i + width / 2 for i in x], [r["ttft_with_s"] for r in rows], width,
           color=[_COLORS.get(r["tier"], "#264653") for r in rows])
    for i, r in enumerate(rows):
        if r["ratio"] is not None:
            ax.annotate(f"{r['ratio']:.2f}x", (i + width / 2, r["ttft_with_s"]),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    for i in range(1, len(rows)):
        if rows[i]["phase"] != rows[i - 1]["phase"]:  # the restart / second-instance replays
            ax.axvline(i - 0.5, color="#6c757d", linestyle="--", linewidth=0.8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("time to first token (s)")
    wl = results["workload"]
    ax.set_title(f"kvtier demo: {wl['conversations']} conversations x {wl['turns']} turns, "
                 f"{wl['system_prompt_tokens']}-token shared system prompt\n"
                 f"device cache flushed before every request; "
                 f"outputs identical: {'yes' if results['summary']['all_identical'] else 'NO'}",
                 fontsize=9)
    used = dict.fromkeys(r["tier"] for r in rows)
    handles = [Patch(color="#adb5bd", label="without kvtier (recompute)")]
    handles += [Patch(color=_COLORS.get(t, "#264653"),
                      label=f"with kvtier, hit from {t}" if t != "none" else "with kvtier, miss")
                for t in used]
    # Below the axes: inside, it would hide the first bars (the tallest: the first turn misses).
    ax.legend(handles=handles, fontsize=8, loc="upper center", ncol=len(handles),
              bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _short(phase: str) -> str:
    return {"multi-turn": "turns", "second-instance": "2nd inst."}.get(phase, phase)
