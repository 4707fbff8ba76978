"""The launcher's side of a stop with kvtier: each scheduler drains its queued writes, and the
launcher waits for their reports, bounded, before SGLang SIGKILLs what is left.

A scheduler with kvtier keeps a file named by its pid in the stop directory (`shutdown.py`
sets it up) until its drain is done; the launcher SIGTERMs those schedulers and waits for the
files to go.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Protocol

__all__ = ["drain_then_kill"]

logger = logging.getLogger(__name__)


class ChildProcess(Protocol):
    """What a stop reads of a child process of the launcher (a `psutil.Process`)."""

    @property
    def pid(self) -> int: ...

    def terminate(self) -> None: ...

    def is_running(self) -> bool: ...

    def status(self) -> str: ...


def drain_then_kill(children: list[ChildProcess], stop_dir: Path, bound_s: float) -> None:
    """SIGTERM every scheduler with kvtier among `children` (psutil processes; those with a
    file in `stop_dir`), wait until each has reported its drain done (its file gone),
    `bound_s` at most, then SIGTERM the other children; a KeyboardInterrupt (a
    second Ctrl-C) cuts the wait. What is still alive is left to the caller's SIGKILL.

    The others wait because a scheduler dies with its parent: at `--dp-size` > 1 the
    schedulers are children of SGLang's data-parallel controller, which dies on SIGTERM, and
    its children are SIGKILLed with it (a test saw both schedulers killed mid-drain).

    Anything else in `stop_dir` (a name that is not a plain decimal pid, a directory) is
    ignored (`_marker_pids`): it must not cost the schedulers their drain."""
    strays: set[str] = set()
    draining = _marker_pids(stop_dir, strays)
    schedulers = [proc for proc in children if proc.pid in draining]
    _terminate(schedulers)
    try:
        _wait_for_drains(stop_dir, schedulers, strays, bound_s)
    finally:
        _terminate([proc for proc in children if proc.pid not in draining])


def _marker_pids(stop_dir: Path, strays: set[str]) -> set[int]:
    """The pids whose scheduler files are in `stop_dir`: regular files named by a plain
    decimal pid (`str(pid)`). Anything else (`123abc`, `0123`, a directory) is not one of
    ours: ignored, logged at debug once per name (`strays` holds those logged). Never raises
    (a missing directory: none)."""
    try:
        entries = list(stop_dir.iterdir())
    except OSError:
        return set()
    pids: set[int] = set()
    for entry in entries:
        name = entry.name
        if name.isascii() and name.isdigit() and str(int(name)) == name and entry.is_file():
            pids.add(int(name))
        elif name not in strays:
            strays.add(name)
            logger.debug("kvtier: %r in the stop directory %s is not a scheduler's file (a "
                         "file named by its pid); ignored", name, stop_dir)
    return pids


def _terminate(procs: list[ChildProcess]) -> None:
    for proc in procs:
        with contextlib.suppress(Exception):  # gone already
            proc.terminate()


def _wait_for_drains(stop_dir: Path, schedulers: list[ChildProcess], strays: set[str],
                     bound_s: float) -> None:
    """Until every scheduler's file is gone, or its process is (a second Ctrl-C stops a
    scheduler at once, before any report), `bound_s` at most."""
    start = time.monotonic()
    deadline = start + bound_s
    alive = {proc.pid: proc for proc in schedulers}

    def reporting() -> list[int]:
        return [pid for pid in _marker_pids(stop_dir, strays)
                if pid in alive and _running(alive[pid])]

    try:
        while (left := reporting()) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = len(_marker_pids(stop_dir, strays) & alive.keys()) - len(left)
    except KeyboardInterrupt:
        logger.warning("kvtier: stop forced: queued writes of the schedulers are dropped")
        return
    finally:
        shutil.rmtree(stop_dir, ignore_errors=True)
    if gone:
        logger.warning("kvtier: %d schedulers stopped before their drain (a second Ctrl-C, or "
                       "a crash); their queued writes are dropped", gone)
    if left:
        logger.warning("kvtier: %d schedulers still draining %.1f s after SIGTERM; SGLang "
                       "kills them (their queued writes are dropped)", len(left),
                       time.monotonic() - start)


def _running(proc: ChildProcess) -> bool:
    try:
        return bool(proc.is_running()) and proc.status() != "zombie"
    except Exception:  # gone
        return False
