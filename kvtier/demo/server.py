"""Start, query and stop a real `python -m sglang.launch_server` process.

A server runs in its own session (process group), so stopping it by its pid also ends the
scheduler and detokenizer processes it spawned. Its output goes to a log file (kvtier logs what
it loads there), printed when the server fails to start.

On a machine without a GPU SGLang runs its CPU engine, which imports `sgl_kernel` (no CPU build
on PyPI): kvtier's stand-in (`kvtier.integration.sglang.launch.cpu.SHIM_DIR`) is put on every
server's PYTHONPATH, servers without kvtier included, unless a real `sgl_kernel` is installed; the
repository's `sglang_cpu/` directory (a plugin that makes prefix hits save attention work on
CPU) goes beside it where the caller asks (`KVTIER_SGLANG_CPU_SHIMS` names it explicitly).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.integration.sglang.launch.cpu import SHIM_DIR, shims_needed

__all__ = ["SGLangServer", "StreamResult", "free_port", "cpu_shims_dir", "server_env",
           "CPU_FLAGS", "gpu_available"]

# Flags measured to serve on a 2-core CPU machine; the caller adds --max-total-tokens.
# --sleep-on-idle: an idle scheduler otherwise polls its sockets without pause, a whole core
# per TP rank (10 CPU seconds in 10 s idle at TP 1, 14 at TP 2; 0.18 and 0.42 with it), taken
# from whatever else runs: another server, kvtier's writers, the client. A request wakes it at
# once (it waits on the socket), and it never sleeps while a request waits for a load.
CPU_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--grammar-backend", "none", "--dtype", "float32", "--skip-server-warmup",
    "--disable-cuda-graph", "--sleep-on-idle", "--log-level", "info",
)
START_TIMEOUT_S = 300.0
SHIMS_ENV = "KVTIER_SGLANG_CPU_SHIMS"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metrics_text(endpoint: int | str) -> str:
    """The Prometheus text a local metrics endpoint serves (`endpoint`: kvtier's
    `metrics_port`, or a server's URL, such as SGLang's with `--enable-metrics`); "" if it
    does not answer."""
    base = f"http://127.0.0.1:{endpoint}" if isinstance(endpoint, int) else endpoint
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
            return str(resp.read().decode())
    except OSError:
        return ""


def gpu_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def cpu_shims_dir() -> Path:
    """The directory holding the demo's SGLang CPU plugin (`kvtier_sglang_cpu`: prefix hits
    that save attention work on CPU).

    `$KVTIER_SGLANG_CPU_SHIMS` if set, else `sglang_cpu/` beside the `kvtier` package (a
    source checkout). `FileNotFoundError` names both when neither holds the plugin.
    """
    explicit = os.environ.get(SHIMS_ENV)
    candidate = Path(explicit) if explicit else \
        Path(__file__).resolve().parents[2] / "sglang_cpu"
    if not (candidate / "kvtier_sglang_cpu.py").is_file():
        raise FileNotFoundError(
            f"no kvtier_sglang_cpu plugin in {candidate}: run from a kvtier checkout or set "
            f"{SHIMS_ENV} to its sglang_cpu/ directory")
    return candidate


def server_env(extra: dict[str, str] | None = None,
               pythonpath: Sequence[Path] = ()) -> dict[str, str]:
    """The environment for an SGLang CPU server: `pythonpath` first on PYTHONPATH, the CPU
    engine on, no hub access, and none of the caller's kvtier/LMCache settings (the server's
    config comes from its flags only)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVTIER_", "LMCACHE_", "SGLANG_PLUGINS"))}
    # The sgl_kernel stand-in too (servers without kvtier, the baselines, need it as well),
    # unless a real sgl_kernel is installed: it must not be shadowed.
    shims = [str(SHIM_DIR)] if shims_needed() else []
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (*map(str, pythonpath), *shims, env.get("PYTHONPATH", "")) if p)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # kvtier's plugin asks PyTorch for huge-page allocations on its CPU servers (huge_pages);
    # the baselines get them too, so that arms differ by the cache only.
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


# How long a flush waits for the server to become idle (SGLang's `timeout` query parameter).
FLUSH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class StreamResult:
    """One streamed generation: seconds to the first streamed token, and the final output."""

    ttft_s: float
    total_s: float
    output_ids: list[int]
    cached_tokens: int
    prompt_tokens: int


PORT_ATTEMPTS = 3


class SGLangServer:
    """One SGLang HTTP server process; use as a context manager or call start()/stop()."""

    def __init__(self, model: Path, log_path: Path, *, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, pythonpath: Sequence[Path] = (),
                 cpu_flags: Sequence[str] = CPU_FLAGS, module: str = "sglang.launch_server"):
        self.model = model
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.env = server_env(env, pythonpath)
        self.cpu_flags = list(cpu_flags)
        self.module = module
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    def start(self, timeout: float = START_TIMEOUT_S) -> SGLangServer:
        self.launch()
        self.wait_ready(timeout)
        return self

    def launch(self) -> None:
        """Start the process without waiting (several servers can then start at once)."""
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        cmd = [sys.executable, "-m", self.module, "--model-path", str(self.model),
               *self.cpu_flags, "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Return once the server answers; on failure stop it, print its log, and raise.

        A free port can be taken between choosing it and binding it (SGLang's own processes
        pick ports too, and servers start side by side): then the server is relaunched on a
        new port, up to `PORT_ATTEMPTS` times.
        """
        assert self.proc is not None, "launch() first"
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._poll_ready(timeout)
                return
            except RuntimeError:
                if attempt < PORT_ATTEMPTS and self._lost_port_race():
                    self.stop()
                    self.port = free_port()
                    self.url = f"http://127.0.0.1:{self.port}"
                    self.launch()
                    continue
                self._fail()
                raise
            except BaseException:
                self._fail()
                raise

    def _lost_port_race(self) -> bool:
        return "address already in use" in self.log()[self._log_start:]

    def _fail(self) -> None:
        self.stop()
        sys.stderr.write(f"--- SGLang server log ({self.log_path}) ---\n{self.log()}\n")

    def _poll_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with code {self.proc.returncode}")
            try:
                req = urllib.request.Request(f"{self.url}/model_info", headers=self._auth())
                with urllib.request.urlopen(req, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"SGLang server not ready after {timeout:.0f}s")

    def _auth(self, admin: bool = False) -> dict[str, str]:
        """The inference clients' header when the server takes `--api-key`; with `admin`, the
        admin's when it takes `--admin-api-key` (SGLang's admin calls such as /flush_cache)."""
        flag = "--admin-api-key" if admin and "--admin-api-key" in self.args else "--api-key"
        if flag not in self.args:
            return {}
        return {"Authorization": f"Bearer {self.args[self.args.index(flag) + 1]}"}

    def stop(self, timeout: float = 5.0) -> int | None:
        """Stop the server's process group (SIGTERM, then SIGKILL after `timeout` s); returns
        the exit code. SIGTERM takes SGLang's graceful stop, in which kvtier writes what it
        still had queued for its lower tiers (4 s at most): give `timeout` room for it where
        those writes matter."""
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

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300, *,
             admin: bool = False) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data,
                                     headers={"Content-Type": "application/json",
                                              **self._auth(admin)})
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

    def stream_generate(self, input_ids: Sequence[int], max_new_tokens: int = 8,
                        timeout: float = 600,
                        on_chunk: Callable[[], None] | None = None) -> StreamResult:
        """Greedy generation through the streaming `/generate` endpoint.

        TTFT is the time from sending the request to the first streamed chunk that carries an
        output token: SGLang sends a chunk only once a token has been sampled, so this is the
        prefill (plus any kvtier load) as a client sees it. `on_chunk` is called as each
        streamed chunk arrives (to time the gaps between tokens).
        """
        body = json.dumps({
            "input_ids": list(input_ids), "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True},
        }).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            start = time.perf_counter()
            conn.request("POST", "/generate", body,
                         {"Content-Type": "application/json", **self._auth()})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"/generate: HTTP {resp.status}: {resp.read()[:500]!r}")
            ttft: float | None = None
            ids: list[int] = []
            last: dict[str, Any] = {}
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                if on_chunk is not None:
                    on_chunk()
                chunk = json.loads(line[5:])
                new = chunk.get("output_ids") or []
                if new and ttft is None:
                    ttft = time.perf_counter() - start
                if new:  # cumulative: these servers run without --incremental-streaming-output
                    ids = [int(i) for i in new]
                last = chunk
            total = time.perf_counter() - start
        finally:
            conn.close()
        if ttft is None:
            raise RuntimeError("/generate streamed no output token")
        meta = last.get("meta_info", {})
        return StreamResult(ttft, total, ids, int(meta.get("cached_tokens", 0)),
                            int(meta.get("prompt_tokens", len(input_ids))))

    def flush_cache(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Empty SGLang's device prefix cache (kvtier's tiers keep their data), once the server
        is idle: SGLang defers a flush with a `timeout` until then (a request whose answer
        was just sent may still be in the scheduler's last batch for a step, more so on a busy
        host; kvtier hands its stores' locks back as soon as they have read the KV). HTTP 400
        if it did not become idle within `timeout_s`."""
        self.post(f"/flush_cache?timeout={timeout_s:g}", timeout=timeout_s + 60, admin=True)

