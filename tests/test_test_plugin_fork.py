"""The test plugin's forked children (harness/sglang_pythonpath): with the variable set, SGLang's
`spawn` start method becomes `fork`, whether SGLang sets it before or after plugins load;
without it, nothing changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.sglang_server import FORK_CHILDREN_ENV

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "harness" / "sglang_pythonpath"
CHECK = """
import multiprocessing as mp, sys
import kvtier_sglang_test_plugin as plugin
if sys.argv[1] == "before":
    mp.set_start_method("spawn", force=True)
if plugin.os.environ.get(plugin.FORK_ENV) == "1":
    plugin._fork_children()
mp.set_start_method("spawn", force=True)  # what SGLang's launcher does
print(mp.get_start_method())
"""


def _method(when: str, fork: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != FORK_CHILDREN_ENV}
    env["PYTHONPATH"] = str(PLUGIN_DIR)
    if fork:
        env[FORK_CHILDREN_ENV] = "1"
    proc = subprocess.run([sys.executable, "-c", CHECK, when], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_harness_and_the_plugin_name_the_same_variable() -> None:
    text = (PLUGIN_DIR / "kvtier_sglang_test_plugin.py").read_text()
    assert f'FORK_ENV = "{FORK_CHILDREN_ENV}"' in text


def test_spawn_becomes_fork_only_when_asked() -> None:
    assert _method("after", fork=True) == "fork"
    assert _method("before", fork=True) == "fork"
    assert _method("after", fork=False) == "spawn"
