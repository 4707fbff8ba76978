"""The metric names docs/metrics.md documents, to check every exported family against."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def family(sample_name: str) -> str:
    """The metric family a sample belongs to (`kvtier_x_total` -> `kvtier_x`)."""
    for suffix in _SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name.removesuffix(suffix)
    return sample_name


def undocumented(sample_names: Iterable[str]) -> list[str]:
    """The kvtier families among `sample_names` that docs/metrics.md does not name in full."""
    documented = {family(name) for name in re.findall(r"`(kvtier_[a-z0-9_]+)", DOC.read_text())}
    return sorted({family(n) for n in sample_names if n.startswith("kvtier_")} - documented)
