"""What every benchmark shares: where a run works and where its results go."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


@contextmanager
def work_dir(name: str, keep_in: Path | None) -> Iterator[Path]:
    """A scratch directory for one run of benchmark `name`: a temporary one, removed afterwards,
    or (`keep_in`, the benchmarks' `--work-dir`) a fresh directory inside `keep_in` that stays,
    so models, configs and server logs can be read after the run."""
    if keep_in is None:
        with tempfile.TemporaryDirectory(prefix=f"kvtier-{name}-") as tmp:
            yield Path(tmp)
        return
    keep_in.mkdir(parents=True, exist_ok=True)
    yield Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=keep_in))


def write_results(name: str, data: Any) -> Path:
    """Write `data` as `benchmarks/results/{name}.json` and say so."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    print(f"wrote {path}")
    return path
