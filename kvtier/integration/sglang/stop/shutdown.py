"""Stopping a server with kvtier: bounded, and nothing lost without a word.

SGLang stops on SIGINT/SIGTERM to its launcher: uvicorn stops accepting requests and then
waits, with no bound, until every streaming response has ended (a long generation kept a
server up for 97 s after Ctrl-C); then SGLang SIGKILLs its scheduler processes, and with them
every store and disk/Redis write kvtier still had queued. Here:

- In the launcher (`http_stop.bound_http_grace`), the first signal gives in-flight requests
  `GRACE_S` seconds; shortly before it ends, each request still running is aborted in the
  scheduler and ends with an error its client sees (`http_stop.cut_requests_at_stop`); a
  second SIGINT forces, as before.
- In the launcher, SGLang's subprocess watchdog stops at the first signal
  (`stop_child_watchdog`): a child that exits during a stop did not crash.
- In the launcher (`drain_then_kill`, around SGLang's HTTP `launch_server`), before the
  SIGKILL each child is sent SIGTERM and given `DRAIN_S` seconds to exit; a second SIGINT
  cuts the wait short.
- SIGTERM to the launcher takes SGLang's own graceful path (in-flight requests finish, then
  each scheduler leaves its loop and releases its host resources): kvtier's radix cache
  drains there (`drain_and_log`, in `release_host_resources`).
- In each scheduler (`install_scheduler_handlers`), SIGTERM drains kvtier: once the batch
  running then is over (`SETTLE_S` at most: the requests the stop aborted finish in it and
  their prefilled prompts are queued for a store), the queued stores
  are finished and the lower-tier writes written, `DRAIN_S` seconds in all, on a thread of
  its own (the scheduler thread may hold a lock a store needs); one log line says how many
  writes were drained, how many were dropped at the stop and how many were lost before it
  (per tier and why: a full queue, a failed or timed-out write, an orphan), a warning if
  any, then the process exits. SIGINT there (a terminal's Ctrl-C reaches every process of
  the group) is left to the launcher, which stops the server as above; a second SIGINT
  stops the scheduler at once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from kvtier.integration.sglang.stop import stop_wait

if TYPE_CHECKING:
    from kvtier.engine import WriteLoss
    from kvtier.integration.sglang.rank.adapter import SGLangKVTier
    from kvtier.integration.sglang.stop.stop_wait import ChildProcess

__all__ = ["GRACE_S", "DRAIN_S", "LAUNCHER_ENV", "Drained", "drain", "drain_and_log",
           "drain_then_kill", "install_scheduler_handlers", "around_launch_server",
           "in_server", "is_launcher", "set_exit_code", "prepare_launcher",
           "leave_sigint_to_launcher", "exit_unfinalized_at_exit", "note_batch",
           "set_up_server_child", "stop_child_watchdog"]

logger = logging.getLogger(__name__)
R = TypeVar("R")

GRACE_S = 3.0  # in-flight requests, after the first signal, before uvicorn aborts them
DRAIN_S = 4.0  # kvtier's queued stores and writes, before the process exits anyway
SETTLE_S = 1.5  # of DRAIN_S: the scheduler's batch running at SIGTERM, before the drain
_EXIT_MARGIN_S = 1.0  # the launcher's wait beyond DRAIN_S: logging and the exit itself
# Set by the launcher for its children: a directory where each scheduler with kvtier keeps a
# file named by its pid until its drain is done (the launcher waits for the directory to
# empty). Without it (an in-process SGLang engine: tests, notebooks) SGLang's own signal
# handling stays.
LAUNCHER_ENV = "KVTIER_STOP_DIR"


def prepare_launcher(*at_start: Callable[[], None]) -> None:
    """In a launcher with kvtier (its arguments parsed): `around_launch_server` takes over the
    stop, and calls `at_start` when the HTTP server starts. Nothing else changes until then (a
    test parsing arguments in its own process stays as it is)."""
    _enabled.append(os.getpid())
    _at_start.extend(at_start)


_at_start: list[Callable[[], None]] = []


def _start_launcher() -> None:
    """The HTTP server starts: the directory the schedulers report in (`LAUNCHER_ENV`, which
    they inherit), and the exit without finalization."""
    import tempfile

    os.environ[LAUNCHER_ENV] = tempfile.mkdtemp(prefix=f"kvtier-stop-{os.getpid()}-")
    _launcher_pid.append(os.getpid())
    exit_unfinalized_at_exit()
    for start in _at_start:
        start()


_enabled: list[int] = []


def in_server() -> bool:
    """Whether this process is a child of a launcher that `prepare_launcher` prepared."""
    return bool(os.environ.get(LAUNCHER_ENV)) and not is_launcher()


def is_launcher() -> bool:
    """Whether this process is a launcher whose HTTP server `around_launch_server` started."""
    return os.getpid() in _launcher_pid


def set_exit_code(code: int) -> None:
    """The launcher's exit status, whatever uvicorn re-raises (`exit_unfinalized_at_exit`)."""
    _exit_code[0] = code


_launcher_pid: list[int] = []


class Drained(NamedTuple):
    """What a drain at exit did: lower-tier writes written during it, writes still pending
    when its time ran out (dropped: the exit loses them), store jobs not finished (their
    writes never queued); and the writes lost before that, since the start, per lower tier
    (`lost`: failed, timed out, refused by a full queue, orphaned, cancelled; none of them
    among `dropped`)."""

    written: int
    dropped: int
    stores_left: int
    seconds: float
    lost: tuple[WriteLoss, ...] = ()

    @property
    def lost_total(self) -> int:
        return sum(loss.total for loss in self.lost)

    def describe(self) -> str:
        """The stop's log line (after "kvtier: stopping: ")."""
        stores = f", {self.stores_left} stores not finished" if self.stores_left else ""
        lost = [str(loss) for loss in self.lost if loss.total]
        before = (f"{self.lost_total} writes lost since the start: {'; '.join(lost)}" if lost
                  else "no write lost before the stop")
        return (f"{self.written} queued writes drained in {self.seconds:.1f} s, {self.dropped} "
                f"dropped (still queued after {DRAIN_S:.0f} s){stores}; {before}")


def drain(kv: SGLangKVTier, bound_s: float = DRAIN_S) -> Drained:
    """Finish `kv`'s queued stores, then write its queued lower-tier writes, `bound_s`
    seconds in all. Nothing new is admitted meanwhile (the HTTP server is down)."""
    start = time.monotonic()
    deadline = start + bound_s
    engine = kv.engine
    before = engine.write_backlog().written
    stores_left = 0 if kv.stores.drain(bound_s) else kv.stores.pending()
    engine.flush(max(0.0, deadline - time.monotonic()))
    after = engine.write_backlog()
    return Drained(after.written - before, after.pending, stores_left,
                   time.monotonic() - start, after.lost)


def leave_sigint_to_launcher() -> None:
    """In a child process of a server (scheduler, detokenizer): the first SIGINT (a
    terminal's Ctrl-C reaches the whole process group) is the launcher's to act on; a second
    one stops this process at once. A child dying on the first would make SGLang's watchdog
    treat the stop as a crash (diagnostics, a minute's wait). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    interrupted = threading.Event()

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if interrupted.is_set():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        interrupted.set()

    signal.signal(signal.SIGINT, on_sigint)


def set_up_server_child() -> None:
    """In a child of a launcher with kvtier (scheduler, detokenizer; nothing elsewhere): the
    first SIGINT is the launcher's, and the exit skips finalization. The plugin calls it as
    the child loads it; a child forked rather than spawned (tests) calls it after the fork."""
    if in_server():
        leave_sigint_to_launcher()
        exit_unfinalized_at_exit()


def install_scheduler_handlers(kv: SGLangKVTier) -> bool:
    """SIGTERM drains `kv` and exits; SIGINT is left to the launcher once (see the module
    docstring). False when not on the main thread (Python allows handlers only there)."""
    if threading.current_thread() is not threading.main_thread():
        logger.debug("kvtier: not on the main thread; SGLang's own signal handling stays")
        return False
    draining = threading.Event()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if draining.is_set():
            return
        draining.set()
        threading.Thread(target=_drain_and_exit, args=(kv,), name="kvtier-exit",
                         daemon=True).start()

    leave_sigint_to_launcher()
    signal.signal(signal.SIGTERM, on_sigterm)
    with contextlib.suppress(OSError):  # no report: the launcher just waits its bound
        _marker().touch()
    return True


def exit_unfinalized_at_exit() -> None:
    """In a server's processes (called early, before SGLang registers its own exit handlers,
    so this one runs after them): leave without the interpreter's finalization, where
    triton's nanobind bindings print a 150-line leak report at every stop."""
    atexit.register(_exit_unfinalized)


def _exit_unfinalized() -> None:
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_exit_code[0])


_exit_code = [0]  # the launcher's, as `around_launch_server` saw it end


def _marker() -> Path:
    return Path(os.environ[LAUNCHER_ENV]) / str(os.getpid())


def drain_and_log(kv: SGLangKVTier, bound_s: float = DRAIN_S) -> None:
    """`drain`, then one line saying what was written and what was dropped, then tell the
    launcher this scheduler is done (SGLang's graceful path drains here, not on the
    launcher's SIGTERM: the launcher waited its whole bound for a report). Never raises."""
    try:
        done = drain(kv, bound_s)
        lossy = done.dropped or done.stores_left or done.lost_total
        logger.log(logging.WARNING if lossy else logging.INFO, "kvtier: stopping: %s",
                   done.describe())
    except Exception:  # a stop must go on whatever the drain hit
        logger.exception("kvtier: stopping: the drain failed; queued writes are dropped")
    finally:
        if in_server():
            with contextlib.suppress(OSError):
                _marker().unlink()


_batch = threading.Event()  # set while the scheduler runs batches (`note_batch`)


def note_batch(running: bool) -> None:
    """The scheduler starts a batch (True), or a turn of its loop found none to run and every
    result is processed (False: `Scheduler.on_idle`). The plugin's hooks call it."""
    if running:
        _batch.set()
    else:
        _batch.clear()


def _settle(bound_s: float) -> float:
    """Wait, `bound_s` at most, until the scheduler's loop runs no batch: the requests the
    stop aborted (http_stop.py) finish in the batch after the abort, and their prefilled KV is
    queued for a store then. Returns the seconds waited."""
    start = time.monotonic()
    while _batch.is_set() and time.monotonic() - start < bound_s:
        time.sleep(0.01)
    return time.monotonic() - start


def _drain_and_exit(kv: SGLangKVTier) -> None:
    try:
        drain_and_log(kv, DRAIN_S - _settle(SETTLE_S))
    finally:
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        os._exit(0)


def drain_then_kill(children: list[ChildProcess], stop_dir: Path) -> None:
    """SIGTERM every scheduler with kvtier among `children` (psutil processes; those with a
    file in `stop_dir`), wait until each has reported its drain done, `DRAIN_S` + a margin at
    most, then SIGTERM the other children (`stop_wait.drain_then_kill`)."""
    stop_wait.drain_then_kill(children, stop_dir, DRAIN_S + _EXIT_MARGIN_S)


def around_launch_server(original: Callable[..., R], *args: object, **kwargs: object) -> R:
    """SGLang's HTTP `launch_server` (AROUND hook), in a launcher with kvtier: however it
    ends (a signal, an error), before the launcher SIGKILLs its children, stop SGLang's
    subprocess watchdog (a scheduler exiting after its drain is not a crash) and let every
    child drain (`drain_then_kill`)."""
    if os.getpid() in _enabled and not is_launcher():
        _start_launcher()
    try:
        return original(*args, **kwargs)
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it stopped on: an exit, no error
        if not is_launcher():
            raise
        logger.info("kvtier: stopped by SIGINT")
        _exit_code[0] = 130
        raise SystemExit(130) from None
    except SystemExit as exc:
        _exit_code[0] = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        raise
    except BaseException:
        _exit_code[0] = 1
        raise
    finally:
        if is_launcher():
            _let_children_drain()


def stop_child_watchdog() -> None:
    """Stop SGLang's subprocess watchdog in this launcher, which SIGQUITs it (a crash's
    diagnostics) when a child exits with an error. Called at a stop's first signal: from then
    on a child's exit is the stop's (a second Ctrl-C ends the children at once, and the
    watchdog's next poll, up to a second later, used to race the launcher's own exit).
    Idempotent; never raises."""
    if "sglang.srt.entrypoints.http_server" not in sys.modules:
        return  # no HTTP server ever ran in this process (a test's), so no watchdog
    try:
        from kvtier.integration.sglang.boundary.sglang_api import tokenizer_manager

        watchdog = getattr(tokenizer_manager(), "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # its thread wakes at once: the join is short
    except Exception:  # no HTTP server state (it never started)
        logger.debug("kvtier: no subprocess watchdog to stop", exc_info=True)


def _let_children_drain() -> None:
    try:
        import psutil

        stop_child_watchdog()
        drain_then_kill(psutil.Process().children(recursive=True),
                        Path(os.environ[LAUNCHER_ENV]))
    except Exception:  # SGLang's own stop must run whatever this hit
        logger.exception("kvtier: could not let the schedulers drain; SGLang stops them")
