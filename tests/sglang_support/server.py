"""Start and stop real `python -m sglang.launch_server` processes on CPU for tests.

A server runs in its own session (process group) so that stopping it by its pid also ends the
scheduler and detokenizer processes it spawned. Its output goes to a log file that is printed
when it fails to start and that tests can read (kvtier logs what it loads and stores there).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SGLangServer", "free_port", "PYTHONPATH_DIR", "CPU_FLAGS", "server_env"]

PYTHONPATH_DIR = Path(__file__).resolve().parent / "pythonpath"
# Flags measured to serve on a 2-core CPU machine (see shared/sglang-on-cpu.md).
CPU_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--grammar-backend", "none", "--dtype", "float32", "--max-total-tokens", "2048",
    "--skip-server-warmup", "--disable-cuda-graph", "--log-level", "info",
)
START_TIMEOUT_S = 180.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for an SGLang CPU server: test stand-ins first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVTIER_", "LMCACHE_", "SGLANG_PLUGINS"))}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PYTHONPATH_DIR), env.get("PYTHONPATH", "")) if p)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class SGLangServer:
    """One SGLang HTTP server process; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        *,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        module: str = "sglang.launch_server",
    ):
        self.model = model
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.env = server_env(env)
        self.module = module
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = START_TIMEOUT_S) -> SGLangServer:
        cmd = [sys.executable, "-m", self.module, "--model-path", str(self.model),
               *CPU_FLAGS, "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            sys.stderr.write(f"--- SGLang server log ({self.log_path}) ---\n{self.log()}\n")
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/model_info", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"SGLang server not ready after {timeout:.0f}s")

    def stop(self, timeout: float = 5.0) -> int | None:
        """Stop the server's process group (SIGTERM, then SIGKILL after `timeout` s); returns
        the exit code. kvtier needs no graceful exit: SGLang SIGKILLs its workers anyway, and
        `/flush_cache` is what makes stored KV durable."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            # The launcher's own SIGTERM handling takes its children down with it.
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        # Children that outlived the leader are still in its process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- requests ----

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")

    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 8) -> dict[str, Any]:
        """Greedy generation from token ids; returns SGLang's response (output_ids, meta_info)."""
        return self.post("/generate", {
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True},
        })

    def flush_cache(self) -> None:
        """Empty SGLang's device prefix cache (kvtier's tiers are untouched)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                self.post("/flush_cache")
                return
            except urllib.error.HTTPError:
                # The scheduler refuses to flush while a request is still finishing.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


@contextlib.contextmanager
def running(model: Path, log_path: Path, **kwargs: Any) -> Iterator[SGLangServer]:
    server = SGLangServer(model, log_path, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()
