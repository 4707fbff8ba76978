"""Run a pip command, leaving out of its output the dependency conflicts kvtier makes on purpose.

    python scripts/pip_quiet.py PIP_COMMAND...      (e.g. .venv/bin/pip install -q -c FILE X)

After an install, pip checks the whole environment and reports every conflict under
"ERROR: pip's dependency resolver does not currently take into account ...". In kvtier's venvs
some are by design: scripts/setup_sglang.sh installs sglang (which pins a multi-GB CUDA torch
and 30-odd CUDA packages), its NODEPS packages and the model package with `--no-deps`, so their
requirements stay unmet. Those lines (and the ERROR header above them, when nothing else is in
its block) are left out: a user cannot act on them. So is setuptools' notice on every editable
install (`pip install -e .`: "Editable installation. ... Please be careful with folders in your
working directory with the same name as your package"), which pip 26 shows even with -q: a
warnings filter in pip's environment, inherited by the build backend, drops it. Everything else
pip prints passes through as it comes, on the stream pip wrote it to.

Exit status: pip's when pip failed; otherwise 1 when pip reported a conflict of another package
(shown, with the header, and a closing line saying the environment is not the tested one),
else 0. So a set-up that succeeds prints no ERROR line, and one that does not says why.
Standard library only: it runs in a venv that holds nothing but pip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

SETUP_SGLANG = Path(__file__).resolve().parent / "setup_sglang.sh"
HEADER = "ERROR: pip's dependency resolver does not currently take into account"
# setuptools' InformationOnly (a UserWarning) on an editable install, by the start of its text.
QUIET_WARNINGS = "ignore:Editable installation:UserWarning"
# "sglang 0.5.23 requires torch==2.14.1, but you have torch 2.13.0+cpu which is incompatible."
# "sglang 0.5.23 requires build, which is not installed."
CONFLICT = re.compile(
    r"^(\S+) \S+ requires .+(, which is not installed| which is incompatible)\.$")


def norm(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def unmet_by_design(script: Path = SETUP_SGLANG) -> frozenset[str]:
    """The packages setup_sglang.sh installs with `--no-deps`: sglang, its NODEPS list and its
    MODEL (read from the script, so one list says what is installed that way)."""
    text = script.read_text()
    nodeps = re.search(r"^NODEPS=\(([^)]*)\)", text, re.M)
    model = re.search(r"^MODEL=(\S+)$", text, re.M)
    if nodeps is None or model is None:
        raise ValueError(f"{script}: no NODEPS=(...) list or MODEL= line")
    return frozenset(norm(n) for n in ["sglang", *nodeps[1].split(), model[1]])


class ConflictFilter:
    """Feeds on pip's stderr line by line; `feed` yields the lines to show. `unexpected` counts
    the conflict lines shown (those of packages not in `expected`)."""

    def __init__(self, expected: Iterable[str]):
        self.expected = frozenset(norm(n) for n in expected)
        self.unexpected = 0
        self._header: str | None = None  # held until a conflict in its block is shown
        self._in_block = False

    def feed(self, line: str) -> Iterator[str]:
        text = line.rstrip("\n")
        if text.startswith(HEADER):
            self._header, self._in_block = line, True
            return
        found = CONFLICT.match(text) if self._in_block else None
        if found is None:
            self._in_block = False
            yield line
            return
        if norm(found[1]) in self.expected:
            return
        self.unexpected += 1
        if self._header is not None:
            yield self._header
            self._header = None
        yield line


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: pip_quiet.py PIP_COMMAND...", file=sys.stderr)
        return 2
    expected = unmet_by_design()
    filt = ConflictFilter(expected)
    env = dict(os.environ)  # the last filter wins: appended to the user's own
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"), QUIET_WARNINGS]))
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
    assert proc.stderr is not None
    for line in proc.stderr:
        for shown in filt.feed(line):
            sys.stderr.write(shown)
            sys.stderr.flush()
    status = proc.wait()
    if status == 0 and filt.unexpected:
        print(f"pip_quiet: {filt.unexpected} dependency conflict(s) above; only those of the "
              "packages scripts/setup_sglang.sh installs --no-deps are expected: this "
              "environment is not the tested one", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
