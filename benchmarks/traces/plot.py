"""Hit rate against CPU-tier capacity, one panel per trace: each policy kvtier replayed
(`replay.py --json`), with LRU, Belady's bound and the no-limit hit rate of the same file.

    python -m benchmarks.traces.plot RESULT.json [RESULT.json ...] --out docs/policies.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["plot"]


def plot(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, result in zip(axes[0], results):
        runs = result["runs"]
        caps = sorted({r["capacity_tokens"] for r in runs})
        bound = {r["capacity_tokens"]: r for r in runs}
        ax.plot(caps, [bound[c]["belady_hit_rate"] for c in caps], "k--", label="Belady (offline)")
        for name in dict.fromkeys(r["policy"] for r in runs):
            rows = sorted((r for r in runs if r["policy"] == name),
                          key=lambda r: r["capacity_tokens"])
            ax.plot([r["capacity_tokens"] for r in rows], [r["hit_rate"] for r in rows],
                    "o-", label=f"kvtier {name}")
        ax.plot(caps, [bound[c]["lru_hit_rate"] for c in caps], "k:", label="LRU (model)")
        ax.axhline(result["infinite_hit_rate"], color="grey", lw=0.8, label="no capacity limit")
        ax.set_xscale("log")
        ax.set_xlabel("CPU tier capacity (tokens)")
        ax.set_ylabel("hit rate (input tokens)")
        ax.set_title(f"{Path(result['trace']).stem}: {result['requests']} requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="replay.py --json outputs")
    parser.add_argument("--out", type=Path, default=Path("docs/policies.png"))
    args = parser.parse_args()
    plot([json.loads(p.read_text()) for p in args.results], args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
