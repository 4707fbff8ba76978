"""Background threads lower their own priority, not the process's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvtier.background import NICE, CpuTime, EngineActivity, copy_alone, lower_priority
from kvtier.config import Config, load_config
from tests.helpers import os_thread_name


def test_lower_priority_applies_to_the_calling_thread_only() -> None:
    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[tuple[int | None, int]] = []

    def worker() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        got = lower_priority()
        seen.append((got, os.getpriority(os.PRIO_PROCESS, tid) - before))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    got, raised = seen[0]
    assert got is not None and raised == min(NICE, 19 - main_before)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before


def test_the_environment_can_turn_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_BACKGROUND_NICE", "0")
    got: list[int | None] = []
    thread = threading.Thread(target=lambda: got.append(lower_priority()))
    thread.start()
    thread.join()
    assert got == [None]
    assert load_config(env={"KVTIER_BACKGROUND_NICE": "0"}) == Config()  # not a config key


def test_kvtier_threads_show_their_names_to_the_os() -> None:
    """`top -H` and a per-thread profile tell kvtier's threads apart (Linux's 15-byte comm)."""
    process_name = Path("/proc/self/comm").read_text()
    seen: list[str] = []

    def worker() -> None:
        copy_alone()  # what the store thread calls first; lower_priority calls it too
        seen.append(os_thread_name())

    thread = threading.Thread(target=worker, name="kvtier-writer-redis")
    thread.start()
    thread.join()
    assert seen == ["kv-writer-redis"]
    assert Path("/proc/self/comm").read_text() == process_name  # the process keeps its own


def test_cpu_time_tells_the_cores_other_processes_took() -> None:
    before = CpuTime(wall=10.0, cores=100.0, own=4.0)
    # 2 s: the cores did 3 CPU-seconds, this process 1 of them
    assert CpuTime(12.0, 103.0, 5.0).others_since(before) == 1.0
    assert CpuTime(12.0, 101.0, 5.0).others_since(before) == 0.0  # never below 0 (tick skew)
    assert CpuTime(10.0, 101.0, 4.0).others_since(before) == 0.0  # no time passed
    now = CpuTime.now()  # Linux: read from /proc/stat
    assert now is not None and now.cores > 0 and now.own >= 0


def test_ran_since_sees_a_running_batch_and_one_that_ended_later() -> None:
    engine = EngineActivity()
    start = time.monotonic()
    assert not engine.ran_since(start)
    engine.enter()
    assert engine.ran_since(time.monotonic() + 1)  # running now
    engine.leave()
    assert engine.ran_since(start) and not engine.ran_since(time.monotonic() + 1)


def test_cpu_time_is_unknown_where_the_os_has_no_cpu_affinity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity")
    assert CpuTime.now() is None  # the rows then keep one thread (rows_forward.rows_threads)
