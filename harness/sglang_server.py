"""Real `python -m sglang.launch_server` processes on CPU for tests.

The server class is the demo's (`kvtier.demo.server`); tests add their own SGLang plugin
(`sglang_pythonpath/`: CPU fixes for tiny MLA models) beside the demo's CPU plugin in
`sglang_cpu/` (the `sgl_kernel` stand-in comes from kvtier's package), and serve with a
2048-token KV pool.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from harness.sglang_zygote import Zygote
from kvtier.demo import server as _server
from kvtier.demo.server import cpu_shims_dir, free_port
from kvtier.integration.sglang.launch.cpu import SHIM_DIR

__all__ = ["SGLangServer", "free_port", "PYTHONPATH_DIRS", "SHIMS_DIR", "CPU_FLAGS", "running",
           "LAUNCHES"]

SHIMS_DIR = SHIM_DIR  # the sgl_kernel stand-in (in-process SGLang imports need it too)
PYTHONPATH_DIRS = (cpu_shims_dir(), Path(__file__).resolve().parent / "sglang_pythonpath")
CPU_FLAGS = (*_server.CPU_FLAGS, "--max-total-tokens", "2048")
FORK_CHILDREN_ENV = "KVTIER_TEST_FORK_CHILDREN"  # read by sglang_pythonpath's test plugin
# The test that launched each server (pytest's PYTEST_CURRENT_TEST), for the suite's budget
# table (tests/support/budget.py): server starts are most of the suite's time.
LAUNCHES: list[str] = []


class SGLangServer(_server.SGLangServer):
    """A CPU test server: the test plugin and the `sgl_kernel` stand-in on its PYTHONPATH.

    With `fork_children` (the default) the test plugin has SGLang fork its scheduler and
    detokenizer processes instead of spawning them: a spawned child imports SGLang again, and
    those imports were two thirds of a server start (28 CPU-seconds -> 10 on the 2-core
    host). Tests of the launch itself (plugins loading in fresh children, signals, the
    README's command) pass `fork_children=False`: SGLang's own spawn.

    With `fork_children` the launcher itself is forked too, from this pytest process's
    zygote (`sglang_zygote.py`), which imported what the launcher imports first once: 10
    CPU-seconds a start -> 3.
    """

    def __init__(self, model: Path, log_path: Path, *, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, module: str = "sglang.launch_server",
                 fork_children: bool = True):
        env = {**(env or {}), **({FORK_CHILDREN_ENV: "1"} if fork_children else {})}
        super().__init__(model, log_path, args=args, env=env, pythonpath=PYTHONPATH_DIRS,
                         cpu_flags=CPU_FLAGS, module=module)
        self.fork_children = fork_children

    def launch(self) -> None:
        LAUNCHES.append(os.environ.get("PYTEST_CURRENT_TEST", ""))
        zygote = _zygote() if self.fork_children and self.module == "sglang.launch_server" \
            else None
        if zygote is None or not zygote.serves(self.env):
            super().launch()
            return
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        argv = ["--model-path", str(self.model), *self.cpu_flags, "--host", "127.0.0.1",
                "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            log.write(f"$ (forked from the zygote) -m {self.module} {' '.join(argv)}\n".encode())
        self.proc = zygote.launch(argv, self.env, self.log_path)  # type: ignore[assignment]

    def kill(self) -> None:
        """Stop at once (SIGKILL to the process group): what a test's teardown needs, since
        nothing a server holds outlives it but what `/flush_cache` made durable. A graceful
        `stop()` costs SGLang's drain, about 5 s a server."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.stop()  # reaps what outlived the leader

    def wait_for_log(self, pattern: str, timeout: float = 30.0) -> list[Any]:
        """The matches of regex `pattern` in the log once there is one (the scheduler logs
        after the HTTP reply of e.g. `/close_session`); fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not (found := re.findall(pattern, self.log())):
            assert time.monotonic() < deadline, f"no {pattern!r} in the log after {timeout}s"
            time.sleep(0.05)
        return found


_ZYGOTES: list[Zygote] = []


def _zygote() -> Zygote | None:
    """This process's zygote, started at its first forked-children server (`None` when
    `KVTIER_TEST_ZYGOTE=0`: every server then starts the usual way)."""
    if os.environ.get("KVTIER_TEST_ZYGOTE") == "0":
        return None
    if not _ZYGOTES:
        env = _server.server_env({FORK_CHILDREN_ENV: "1"}, PYTHONPATH_DIRS)
        _ZYGOTES.append(Zygote(env, Path(tempfile.mkdtemp(prefix="kvtier-zygote-"))))
        atexit.register(_ZYGOTES[0].close)
    return _ZYGOTES[0]


@contextlib.contextmanager
def running(model: Path, log_path: Path, **kwargs: Any) -> Iterator[SGLangServer]:
    server = SGLangServer(model, log_path, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.kill()
