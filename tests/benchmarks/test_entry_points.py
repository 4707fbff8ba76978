"""Every benchmark runs from the checkout's root as `python -m benchmarks.<family>.<name>`,
with no `PYTHONPATH` or other environment tweak, and its documented command says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
ENTRY_POINTS = sorted([*BENCHMARKS.glob("*/bench_*.py"), BENCHMARKS / "traces" / "replay.py"])
MODULES = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in ENTRY_POINTS]
# Where users read the commands (benchmarks/LOG.md records what was run on its date, as run).
DOCS = [*ENTRY_POINTS, ROOT / "README.md", ROOT / "Makefile", BENCHMARKS / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]

# One interpreter for all of them (torch is imported once): each module runs as `-m` would
# run it, with `--help`, and must exit 0 after printing its usage.
RUN_ALL = """
import runpy, sys
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    try:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        assert stop.code in (0, None), (name, stop.code)
    else:
        raise AssertionError(f"{name} --help did not exit")
    print("ran", name, flush=True)
"""


def test_there_are_entry_points_to_check() -> None:
    assert len(MODULES) >= 15 and "benchmarks.serving.bench_blend" in MODULES


def test_every_benchmark_runs_as_a_module_without_pythonpath() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", RUN_ALL, *MODULES], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ran = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ran ")]
    assert ran == MODULES
    assert proc.stdout.count("usage:") >= len(MODULES)


def test_documented_commands_need_no_pythonpath() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{n}" for path in DOCS
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if "PYTHONPATH=." in line]
    assert not offenders, offenders
