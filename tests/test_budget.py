"""The suite's time budget (tests/support/budget.py): the per-module table, and a run over its
budget fails naming its three slowest modules."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.support.budget import DEFAULT_BUDGET_S, SuiteBudget, budget_from_env


class _Terminal:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def section(self, title: str) -> None:
        self.lines.append(f"== {title}")

    def write_line(self, line: str, **markup: bool) -> None:
        self.lines.append(line)


def _ran(plugin: SuiteBudget, seconds: dict[str, float]) -> None:
    for nodeid, secs in seconds.items():
        plugin.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=secs))


def _phase(plugin: SuiteBudget, nodeid: str, secs: float) -> SimpleNamespace:
    """One phase of a test through the plugin's hooks, as pytest (or an xdist worker) runs
    them: its report is made, then logged."""
    report = SimpleNamespace(nodeid=nodeid, duration=secs, user_properties=[])
    wrapper = plugin.pytest_runtest_makereport(None, None)  # type: ignore[arg-type]
    next(wrapper)
    with pytest.raises(StopIteration):
        wrapper.send(SimpleNamespace(get_result=lambda: report))
    plugin.pytest_runtest_logreport(report)  # type: ignore[arg-type]
    return report


def _finish(plugin: SuiteBudget, took_s: float) -> tuple[int, list[str]]:
    plugin.started = time.monotonic() - took_s
    session = SimpleNamespace(exitstatus=0, testscollected=4)
    plugin.pytest_sessionfinish(session, 0)
    terminal = _Terminal()
    plugin.pytest_terminal_summary(terminal)
    return int(session.exitstatus), terminal.lines


RUN = {"tests/a.py::t1": 5.0, "tests/a.py::t2": 50.0, "tests/b.py::t": 30.0,
       "tests/c.py::t": 80.0, "tests/d.py::t": 1.0}


def test_a_run_over_its_budget_fails_naming_the_three_slowest_modules() -> None:
    plugin = SuiteBudget(budget_s=100, launches=list)
    _ran(plugin, RUN)
    status, lines = _finish(plugin, took_s=170)
    assert status == pytest.ExitCode.TESTS_FAILED
    (failed,) = [line for line in lines if line.startswith("FAILED")]
    assert "took 170 s, over its budget of 100 s" in failed
    assert failed.endswith("tests/c.py (80 s), tests/a.py (55 s), tests/b.py (30 s)")
    assert lines[1].split() == ["80.0", "s", "tests/c.py"]  # the table, slowest first


def test_a_run_within_its_budget_passes_and_still_shows_where_time_went() -> None:
    launches: list[str] = []
    plugin = SuiteBudget(budget_s=1000, launches=lambda: launches)
    for nodeid, secs in RUN.items():
        launches += {"tests/c.py::t": ["setup", "call"], "tests/a.py::t2": ["call"]}.get(nodeid,
                                                                                       [])
        _phase(plugin, nodeid, secs)
    status, lines = _finish(plugin, took_s=170)
    assert status == 0 and not [line for line in lines if line.startswith("FAILED")]
    assert lines[1].endswith("tests/c.py  (2 SGLang servers)")
    assert "166.0 s  in all, 4 modules, 3 SGLang servers" in lines[-1]


def test_a_budget_of_zero_turns_the_check_off() -> None:
    plugin = SuiteBudget(budget_s=0, launches=list)
    _ran(plugin, RUN)
    assert _finish(plugin, took_s=1e6)[0] == 0


def test_the_budget_comes_from_the_environment_by_name() -> None:
    assert budget_from_env({}) == DEFAULT_BUDGET_S
    assert budget_from_env({"KVTIER_SUITE_BUDGET_S": "1500"}) == 1500.0
    with pytest.raises(ValueError, match="KVTIER_SUITE_BUDGET_S .* got '25m'"):
        budget_from_env({"KVTIER_SUITE_BUDGET_S": "25m"})
    with pytest.raises(ValueError, match="KVTIER_SUITE_BUDGET_S must be >= 0"):
        SuiteBudget(-1)


def test_servers_are_counted_from_the_reports_so_xdist_workers_count_too() -> None:
    """Each phase's report names only the servers launched during it (pytest gives every
    phase the item's one list: a count must not leak into the next phase's report)."""
    launches: list[str] = []
    worker = SuiteBudget(budget_s=0, launches=lambda: launches)
    launches.append("tests/a.py::t (setup)")
    setup = _phase(worker, "tests/a.py::t", 1.0)
    call = _phase(worker, "tests/a.py::t", 1.0)
    assert setup.user_properties == [("kvtier_sglang_servers", 1)]
    assert call.user_properties == []
    controller = SuiteBudget(budget_s=0, launches=list)  # launches nothing itself
    for report in (setup, call):
        controller.pytest_runtest_logreport(report)  # type: ignore[arg-type]
    assert controller.servers == {"tests/a.py": 1}
