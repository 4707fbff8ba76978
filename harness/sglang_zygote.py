"""A warm launcher for test servers: one process per pytest process that has imported
`sglang.launch_server` once, and forks a server launcher per test server.

A launcher's imports were most of a test server's start (about 7 of its 10 CPU-seconds on the
2-core host: torch, transformers and SGLang's server arguments), paid again for each of the
suite's forty-odd forked-children servers. Forked from here, a launcher starts with those
modules imported and runs `python -m sglang.launch_server` from its first line, so the order
of everything after them is the real command's: the plugins load first, then the HTTP server
and the engine. Only what the real command imports before it runs anything is imported here.

The child is what `Popen(start_new_session=True)` would make: a session of its own (its pid
is its process group, so `killpg` stops it and its children), stdout and stderr on the
server's log, the server's environment, argv and working directory, fresh random seeds (SGLang
picks some ports at random: forked twins must not pick the same). `ZygoteProcess` is the
`Popen` subset the harness uses; the zygote reports each child's exit status to it.

Protocol, one Unix-socket connection per server: the harness sends one JSON line (argv, env,
cwd, log), the zygote answers `{"pid": N}` and, when the child exits, `{"returncode": N}`
(negative for a signal, as `Popen`'s).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

MODULE = "sglang.launch_server"
# Imported too, after MODULE: what the launcher's plugins import when their hooks apply (the
# HTTP server, the scheduler) and what every scheduler imports before it loads a model (all of
# SGLang's model classes). A spawned scheduler imports them before it loads the plugins too,
# so plugins that work there work here.
WARM = ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
        "sglang.srt.managers.detokenizer_manager", "sglang.srt.models.registry")
REAP_S = 0.05  # how often the zygote collects exited children


# ---- the zygote process ----

def _serve(path: str, module: str) -> None:
    """Accept launches of `python -m module` on the Unix socket `path` until stdin closes (the
    pytest process that started the zygote has gone)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    os.dup2(2, 1)  # nobody reads the pipe from now on
    while True:
        for key, _ in selector.select(REAP_S):
            if key.fileobj is sys.stdin:
                return
            conn, _ = listener.accept()
            pid = _launch(conn, module, listener, [*children.values()])
            if pid:
                children[pid] = conn
        _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(b'{"returncode": %d}\n' % os.waitstatus_to_exitcode(status))
            conn.close()


def _launch(conn: socket.socket, module: str, *inherited: Any) -> int:
    request = json.loads(conn.makefile("rb").readline())
    pid = os.fork()
    if pid == 0:
        for sock in (conn, inherited[0], *inherited[1]):
            sock.close()
        _become_server(request, module)  # never returns
    conn.sendall(b'{"pid": %d}\n' % pid)
    return pid


def _become_server(request: dict[str, Any], module: str) -> None:
    code: Any = 1
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as `python -m` puts it
        os.environ.clear()
        os.environ.update(request["env"])
        _reseed()
        sys.argv = [module, *request["argv"]]
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if isinstance(code, str):
            sys.stderr.write(code + "\n")
        os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def _reseed() -> None:
    import random

    import numpy
    import torch

    random.seed()
    numpy.random.seed()
    torch.seed()


# ---- the harness's side ----

class ZygoteProcess:
    """The part of `subprocess.Popen` the harness uses, for a server forked by the zygote."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._buffer = b""
        reply = self._line(None)
        if reply is None:
            raise RuntimeError("the SGLang zygote closed the connection before forking")
        self.pid: int = json.loads(reply)["pid"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._collect(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0.0)
            self._collect(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def _collect(self, timeout: float | None) -> None:
        try:
            line = self._line(timeout)
        except TimeoutError:
            return
        if line is not None:
            self.returncode = int(json.loads(line)["returncode"])
        elif not _alive(self.pid):  # the zygote went first: the status is lost
            self.returncode = -signal.SIGKILL
        else:
            time.sleep(min(REAP_S, timeout if timeout is not None else REAP_S))

    def _line(self, timeout: float | None) -> bytes | None:
        """The next line from the zygote; None once it closed the connection; TimeoutError
        when no line came within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                raise TimeoutError
            data = self._conn.recv(4096)
            if not data:
                return None
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Zygote:
    """A zygote of `python -m module`, started with `env` (a server environment: what the
    imports read, such as PYTHONPATH and OMP_NUM_THREADS, is fixed by it)."""

    def __init__(self, env: dict[str, str], workdir: Path, module: str = MODULE,
                 warm: tuple[str, ...] = WARM) -> None:
        self.env = env
        self.path = str(workdir / "zygote.sock")
        with open(workdir / "zygote.log", "ab") as log:  # what the imports print
            self.proc = subprocess.Popen(
                [sys.executable, __file__, self.path, module, *warm], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if ready.strip() != b"ready":
            self.proc.kill()
            raise RuntimeError(f"the SGLang zygote did not start: {ready!r}")

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a server with `env` may be forked from here: the variables read at import
        time equal the zygote's."""
        return self.proc.poll() is None and all(
            env.get(k) == self.env.get(k) for k in IMPORT_TIME_ENV)

    def launch(self, argv: list[str], env: dict[str, str], log: Path) -> ZygoteProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendall(json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(),
                                 "log": str(log)}).encode() + b"\n")
        return ZygoteProcess(conn)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the zygote's cue to go
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _title_settable() -> None:
    """Let the children name themselves: setproctitle finds the argv it overwrites through the
    first environment string, the first time it is called, and a child that replaced its
    environment (`_become_server`) leaves it nothing to find: SGLang's scheduler kept the
    zygote's command line, and SGLang's stop, which waits only for processes named
    `sglang::scheduler`, SIGKILLed it before its drain. Called here once, before any fork."""
    import setproctitle

    setproctitle.setproctitle("kvtier-test-zygote " + " ".join(sys.argv[1:3]))


# Read when the launcher's modules are imported: a server whose value differs starts the
# usual way.
IMPORT_TIME_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "THP_MEM_ALLOC_ENABLE",
                   "SGLANG_USE_CPU_ENGINE", "PYTHONHASHSEED", "LD_PRELOAD", "HF_HOME")


if __name__ == "__main__":
    import importlib

    sys.path[0] = os.getcwd()  # as `python -m` has it
    for name in sys.argv[2:]:
        importlib.import_module(name)
    _title_settable()
    _serve(sys.argv[1], sys.argv[2])
