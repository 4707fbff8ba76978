"""The test servers' zygote (harness/sglang_zygote.py): a launch forked from it sees what a
`Popen(start_new_session=True)` of `python -m module` would (its argv, environment and working
directory, a session and process group of its own, its output on its log, random seeds of its
own), and its exit status reaches the harness as `Popen` reports it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.sglang_zygote import Zygote

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    zygote = Zygote(env, tmp_path_factory.mktemp("zygote"), module="tests.support.zygote_probe",
                    warm=())
    yield zygote
    zygote.close()
    assert zygote.proc.returncode == 0  # stdin closed: it left on its own


def _seen(log: Path) -> dict[str, object]:
    return json.loads(log.read_text().splitlines()[-1])


def test_a_launch_sees_its_argv_environment_cwd_and_session(zygote: Zygote,
                                                            tmp_path: Path) -> None:
    env = {**zygote.env, "ZYGOTE_PROBE": "on"}
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [zygote.launch(["exit", "3"], env, log) for log in logs]
    assert [proc.wait(60) for proc in procs] == [3, 3]
    seen = [_seen(log) for log in logs]
    assert seen[0]["argv"] == ["exit", "3"] and seen[0]["probe"] == "on"
    assert seen[0]["cwd"] == os.getcwd()
    assert seen[0]["leader"] and seen[0]["session"]
    assert seen[0]["random"] != seen[1]["random"]  # reseeded: twins pick different ports
    assert procs[0].pid != procs[1].pid


def test_a_signalled_launch_reports_the_signal_like_popen(zygote: Zygote,
                                                          tmp_path: Path) -> None:
    log = tmp_path / "sleep.log"
    proc = zygote.launch(["sleep"], zygote.env, log)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.5)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)  # its own group, as the harness's teardown sends
    assert proc.wait(60) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL
    proc.send_signal(signal.SIGTERM)  # a no-op once it is gone


def test_only_servers_with_the_zygote_s_import_time_environment_are_forked(
        zygote: Zygote) -> None:
    assert zygote.serves({**zygote.env, "KVTIER_ANYTHING": "1"})
    assert not zygote.serves({**zygote.env, "PYTHONPATH": "/elsewhere"})
    assert not zygote.serves({**zygote.env, "OMP_NUM_THREADS": "7"})
