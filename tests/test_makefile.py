"""What the Makefile's suite targets run, read with `make -n` (which runs nothing): a skipped
test says why (the GPU cases on a machine without one, issue 74)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("target", ["test", "test-fast", "test-latest"])
def test_a_suite_target_prints_why_each_skipped_test_skipped(target: str) -> None:
    out = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    runs = [line for line in out.splitlines() if " -m pytest " in line]
    assert runs, out
    for line in runs:
        assert " -rs " in f"{line} ", f"make {target} runs pytest without -rs: {line}"
