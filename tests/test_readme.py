"""The README's claims stay tied to their sources: its summary of `make anchors` names the
date of the newest such run in benchmarks/LOG.md, and its install line is the one pip runs
from the checkout's root (tests/test_install.py runs it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_summarises_the_newest_anchors_run() -> None:
    bench = (ROOT / "benchmarks" / "LOG.md").read_text()
    dates = re.findall(r"^###.*`make anchors`.*?\((\d{4}-\d{2}-\d{2})", bench, re.M)
    assert dates, "benchmarks/LOG.md has no `make anchors` section"
    measured = (ROOT / "README.md").read_text().split("## Measured", 1)[1].split("\n## ", 1)[0]
    assert f"Latest ({max(dates)})" in measured


def test_the_install_line_names_the_checkout_it_runs_in() -> None:
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines()
             if ln.startswith("pip install '.[")]
    assert len(lines) == 1, lines
    assert (ROOT / "pyproject.toml").is_file()  # `.` is the checkout's root, where it runs


def test_the_readme_stays_a_page() -> None:
    """A product page, not a manual: details live in docs/ and benchmarks/ (issue 52)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move details into docs/"


def test_the_cpu_launch_line_serves_the_demos_dtype() -> None:
    """The README's CPU line and `make demo` serve the same dtype, so their numbers compare
    (without `--dtype`, SGLang serves a float32 model in float16)."""
    from benchmarks.serving.bench_readme_cpu import readme_cpu_launch
    from kvtier.demo.server import CPU_FLAGS

    def dtype(flags: list[str]) -> str | None:
        return flags[flags.index("--dtype") + 1] if "--dtype" in flags else None

    demo = dtype(list(CPU_FLAGS))
    assert demo == "float32"
    assert dtype(readme_cpu_launch()) == demo
    torch_lines = [ln for ln in (ROOT / "README.md").read_text().splitlines()
                   if ln.startswith("pip install torch==") and "/whl/cpu" in ln]
    assert len(torch_lines) == 1, "the README shows no CPU torch command to copy"
    tested = re.search(r"^TORCH := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert tested and torch_lines[0].split()[2] == tested[1]  # the torch `make setup` installs
