"""kvtier/demo/quiet.py: the host-load sampler and the wait for a kvtier server's writes (no
SGLang: a fake /proc, a thread that spins, and a local HTTP endpoint serving the gauge)."""

from __future__ import annotations

import http.server
import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.demo.quiet import BUSY_CORES, HostMeter, WriteWaits, busy, wait_for_writes
from kvtier.demo.report import format_host, format_host_start
from kvtier.demo.server import free_port

TICK = os.sysconf("SC_CLK_TCK")
ME = os.getpid()


def _write_proc(root: Path, busy_ticks: int, steal: int, procs: dict[int, tuple[int, int, int]],
                ) -> None:
    """A /proc with a `cpu` line and, per pid, (ppid, pgid, utime + stime in ticks)."""
    root.mkdir(exist_ok=True)
    # user nice system idle iowait irq softirq steal
    (root / "stat").write_text(f"cpu  {busy_ticks} 0 0 99999 7 0 0 {steal} 0 0\ncpu0 1 2 3\n")
    for pid, (ppid, pgid, ticks) in procs.items():
        (root / str(pid)).mkdir(exist_ok=True)
        # a command name with a space and a parenthesis, as /proc may show one
        (root / str(pid) / "stat").write_text(
            f"{pid} (a (b) c) S {ppid} {pgid} {pgid} 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0 1 0\n")
    (root / "self").mkdir(exist_ok=True)  # not a pid: skipped


def test_host_meter_counts_the_demos_own_processes_apart_from_others(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    # me, my child (a redis-server), a server's scheduler (its group 500), and a stranger
    before = {ME: (1, 1, 0), 401: (ME, 1, 0), 501: (500, 500, 0), 900: (1, 900, 0)}
    _write_proc(proc, busy_ticks=0, steal=0, procs=before)
    clock = itertools.count(0.0, 10.0)  # every sample 10 s after the last
    meter = HostMeter(groups=lambda: [500], proc=proc, clock=lambda: next(clock))
    meter.open()
    # 10 s later: the host was busy 16 s (1.6 cores), 10 s of it the demo's (4 + 1 + 5), the
    # stranger the rest; the hypervisor took 1 s.
    after = {ME: (1, 1, 4 * TICK), 401: (ME, 1, 1 * TICK), 501: (500, 500, 5 * TICK),
             900: (1, 900, 6 * TICK)}
    _write_proc(proc, busy_ticks=16 * TICK, steal=1 * TICK, procs=after)
    meter.close()
    assert meter.cores_used() == {"window_s": 10.0, "other_cores": 0.6, "own_cores": 1.0,
                                  "steal_cores": 0.1}
    assert busy(meter.cores_used())  # 0.6 + 0.1 >= half a core

    # A second window adds to the first: 10 s more, 2 s of others' CPU only.
    meter.open()
    _write_proc(proc, busy_ticks=18 * TICK, steal=1 * TICK, procs=after)
    meter.close()
    assert meter.cores_used() == {"window_s": 20.0, "other_cores": 0.4, "own_cores": 0.5,
                                  "steal_cores": 0.05}
    assert not busy(meter.cores_used())


def test_host_meter_without_proc_reports_unknown(tmp_path: Path) -> None:
    meter = HostMeter(proc=tmp_path / "nothing")
    meter.open()
    meter.close()
    assert meter.cores_used() == {"window_s": 0.0, "other_cores": None, "own_cores": None,
                                  "steal_cores": None}
    assert not busy(meter.cores_used())


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="reads Linux's /proc")
def test_host_meter_on_this_host_counts_a_spinning_thread_as_own() -> None:
    meter = HostMeter()
    meter.open()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    meter.close()
    used = meter.cores_used()
    assert used["window_s"] >= 0.3
    # A tick is 10 ms; a spinning process gets less than its 0.3 s on a busy host, not none.
    assert used["own_cores"] > 0 and used["other_cores"] >= 0 and used["steal_cores"] >= 0
    assert meter.load_peak is not None


class _Gauge:
    """A metrics endpoint whose write queue empties after `busy_scrapes` scrapes."""

    def __init__(self, busy_scrapes: int | None):
        self.busy_scrapes, self.scrapes = busy_scrapes, 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        gauge = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                gauge.scrapes += 1
                left = gauge.busy_scrapes is None or gauge.scrapes <= gauge.busy_scrapes
                body = ("# TYPE kvtier_write_queue gauge\n"
                        f'kvtier_write_queue{{tier="disk"}} {3.0 if left else 0.0}\n'
                        f'kvtier_write_queue{{tier="redis"}} {2.0 if left else 0.0}\n'
                        "kvtier_writes_total{tier=\"disk\"} 7.0\n").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def gauge(request: pytest.FixtureRequest) -> Iterator[_Gauge]:
    g = _Gauge(request.param)
    yield g
    g.server.shutdown()
    g.server.server_close()


@pytest.mark.parametrize("gauge", [3], indirect=True)
def test_wait_for_writes_returns_once_the_queue_is_empty(gauge: _Gauge) -> None:
    got = wait_for_writes(gauge.url, timeout=30, poll_s=0.01)
    assert got.left == 0 and gauge.scrapes == 4  # three busy answers, then the empty one


@pytest.mark.parametrize("gauge", [None], indirect=True)
def test_wait_for_writes_is_bounded(gauge: _Gauge) -> None:
    got = wait_for_writes(gauge.url, timeout=0.2, poll_s=0.01)
    assert got.left == 5 and got.waited_s >= 0.2  # both tiers' queues, summed


def test_wait_for_writes_without_an_endpoint_returns_at_once() -> None:
    got = wait_for_writes(f"http://127.0.0.1:{free_port()}", timeout=30)
    assert got.left is None and got.waited_s < 30


class _Server:
    flushes = 0

    def __init__(self, url: str):
        self.url = url

    def flush_cache(self) -> None:
        self.flushes += 1


@pytest.mark.parametrize("gauge", [1], indirect=True)
def test_write_waits_flush_the_server_then_wait_for_the_gauge(gauge: _Gauge) -> None:
    waits = WriteWaits(timeout=30)
    servers = [_Server(gauge.url), _Server(f"http://127.0.0.1:{free_port()}")]  # 2nd: no endpoint
    for server in servers:
        waits.wait(server)  # type: ignore[arg-type]
    assert [s.flushes for s in servers] == [1, 1]  # the flush, gauge or not
    summary = waits.summary()
    assert (summary["waits"], summary["timed_out"], summary["no_gauge"]) == (2, 0, 1)
    assert summary["max_s"] <= summary["total_s"]


def test_the_host_lines_say_when_others_are_busy() -> None:
    quiet = {"load_average": (0.1, 0.2, 0.3), "window_s": 1.0, "other_cores": 0.05,
             "own_cores": 0.9, "steal_cores": 0.0}
    lines = format_host_start(2, quiet)
    assert lines[0] == ("host: 2 cores, load average 0.1 0.2 0.3, other processes using 0.05 "
                        "cores (over 1.0 s)")
    assert "share these cores" in lines[1] and len(lines) == 2
    noisy = {**quiet, "other_cores": BUSY_CORES + 0.3}
    assert format_host_start(2, noisy)[-1].startswith("note: other processes 0.80 of 2 cores")
    host = {"cores": 2, "write_waits": WriteWaits().summary(),
            "measured": {"load_average_first": (1.5, 1.0, 0.5), "load_average_peak": 2.5,
                         "load_average_end": (1.0, 1.0, 0.5), **noisy, "window_s": 300.0}}
    lines = format_host(host)
    assert lines[0].startswith("host during the measured requests (300 s): other processes "
                               "0.80 cores, the demo's own 0.90, of 2; load average 1.5")
    assert lines[1].startswith("waits for the kvtier server's writes")
    assert "during the measured requests" in lines[-1] and lines[-1].startswith("note:")
