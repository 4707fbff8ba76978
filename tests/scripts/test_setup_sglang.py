"""scripts/setup_sglang.sh's output (issue 74, item 7): a failed pip install shows pip's error
and fails the set-up; a complete environment is one line, no ERROR. A full install takes minutes,
so the venv here is a stand-in: its `python` is this interpreter, except that `python -m pip`
fails as pip does when the package index has no such version (nothing is ever installed)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "setup_sglang.sh"
PIP_ERROR = "ERROR: No matching distribution found for sglang==0.5.23"


def venv_without_pip(tmp_path: Path) -> Path:
    """A venv directory whose bin/python runs this interpreter but fails `-m pip`."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then\n'
                      f'    echo "{PIP_ERROR}" >&2\n    exit 1\nfi\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python.parent.parent


def run_setup(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_CONSTRAINTS"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


def test_a_failing_pip_fails_the_setup_with_its_error_shown(tmp_path: Path) -> None:
    # --latest: no completeness check, so the first install runs (and fails) at once
    proc = run_setup("--latest", str(venv_without_pip(tmp_path)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert PIP_ERROR in proc.stderr.splitlines()
    assert "done" not in proc.stdout


@pytest.mark.sglang
def test_a_complete_environment_prints_one_line_and_no_error(tmp_path: Path) -> None:
    """The environment running the suite (`make test` builds it with `make sglang-env`): the
    script finds it complete and installs nothing (were it to try, the stand-in's pip fails)."""
    venv = venv_without_pip(tmp_path)
    proc = run_setup(str(venv))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == f"setup_sglang: sglang 0.5.23 environment already complete in {venv}\n"
    assert proc.stderr == ""
