"""The gateway in front of a fleet, and SGLang servers as its workers.

SMG (`smg launch`, the Shepherd Model Gateway, PyPI `smg`) is the fleet's router of record;
sglang-router (`python -m sglang_router.launch_router`) is the legacy one. Both are processes
started here on a free loopback port and stopped by their pid.

SMG's `cache_aware` policy is event-driven when its workers are gRPC workers: an SGLang server
started with `--smg-grpc-mode` (the smg-grpc-servicer package) and `--kv-events-config` relays
its ZMQ KV events (`SubscribeKvEvents`), kvtier's tier events among them (`CPU_PINNED`, `DISK`,
`EXTERNAL`: the relay maps them to its host, disk and external tiers), and SMG routes on the
blocks each worker reports. Over HTTP workers SMG, like sglang-router, keeps an approximate tree
of what it sent where. A gRPC server answers no HTTP: it is ready when its log says so, and its
device cache is flushed through the gateway (`/flush_cache` reaches every worker).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.demo.server import SGLangServer, free_port

__all__ = ["ROUTERS", "Gateway", "grpc_worker_args", "make_grpc_worker", "wait_grpc_ready",
           "worker_url"]

ROUTERS = ("smg", "sglang-router")
READY_LINE = "The server is fired up and ready to roll"
START_TIMEOUT_S = 300.0


def grpc_worker_args(port: int, events_port: int | None = None) -> list[str]:
    """The flags that make the SGLang server on `port` an event-publishing gRPC worker for SMG:
    the smg-grpc-servicer front end, and SGLang's ZMQ KV-event publisher on a loopback port
    (`events_port`, else a free one) for the servicer to relay. The servicer listens on
    `--port`; SGLang checks `--grpc-port`, which it would otherwise derive as `--port` + 10000
    (past 65535 for a port above 55535, and then the launch fails): it is named the same."""
    events = events_port if events_port is not None else free_port()
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}", "topic": "kv-events"}
    return ["--smg-grpc-mode", "--grpc-port", str(port), "--kv-events-config",
            json.dumps(config)]


def make_grpc_worker(server: SGLangServer) -> SGLangServer:
    """`server` (not launched yet) with `grpc_worker_args` for its port added to its flags."""
    if server.proc is not None:
        raise ValueError("server: already launched; make it a gRPC worker before launch()")
    server.args += grpc_worker_args(server.port)
    return server


def worker_url(server: SGLangServer, grpc: bool) -> str:
    """How a gateway names `server`: `grpc://` for a `--smg-grpc-mode` server."""
    return f"grpc://127.0.0.1:{server.port}" if grpc else server.url


def wait_grpc_ready(server: SGLangServer, timeout: float = START_TIMEOUT_S) -> None:
    """Return once a `--smg-grpc-mode` server logged that it serves. Raises RuntimeError (with
    the log's tail) when it exited, TimeoutError after `timeout` seconds."""
    assert server.proc is not None, "launch() first"
    deadline = time.monotonic() + timeout
    while READY_LINE not in server.log():
        if server.proc.poll() is not None:
            raise RuntimeError(f"gRPC SGLang server exited ({server.proc.returncode}): "
                               f"{server.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"gRPC SGLang server not ready after {timeout:.0f}s")
        time.sleep(0.2)


class Gateway:
    """A router process (`router` in ROUTERS) over `workers` (URLs), on a free loopback port.

    Retries are off (`--disable-retries`): a worker's fault shows as a failed request.
    `model` names the served model in requests (SMG routes by it) and gives SMG its tokenizer.
    Raises ValueError for an unknown `router`, RuntimeError when it does not come up (its log
    is in `log`).
    """

    def __init__(self, router: str, workers: Sequence[str], policy: str, log: Path, *,
                 model: Path | None = None, extra: Sequence[str] = ()) -> None:
        if router not in ROUTERS:
            raise ValueError(f"router: {router!r} is not one of {ROUTERS}")
        self.router = router
        self.workers = list(workers)
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        cmd = self._command(policy, extra)
        with open(log, "ab") as out:
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _command(self, policy: str, extra: Sequence[str]) -> list[str]:
        common = ["--host", "127.0.0.1", "--port", str(self.port), "--worker-urls",
                  *self.workers, "--policy", policy, "--disable-retries",
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        if self.router == "sglang-router":
            return [sys.executable, "-m", "sglang_router.launch_router", *common, *extra]
        model = ["--model-path", str(self.model)] if self.model is not None else []
        return [sys.executable, "-m", "smg", "launch", *common, *model, "--log-level", "info",
                *extra]

    def _wait_ready(self, timeout: float = 120.0) -> None:
        """Until every worker is registered and healthy (SMG's `/workers`; sglang-router's
        `/health`)."""
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.router} did not come up; see {self.log_path}:\n"
                                   f"{self.log()[-3000:]}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            if self.router == "sglang-router":
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    return bool(resp.status == 200)
            with urllib.request.urlopen(f"{self.url}/workers", timeout=2) as resp:
                listed = json.loads(resp.read()).get("workers", [])
        except (OSError, ValueError):
            return False
        healthy = [w for w in listed if w.get("is_healthy") and w.get("status") == "ready"]
        return len(healthy) == len(self.workers)

    def post(self, path: str, body: dict[str, Any], timeout: float = 300.0) -> Any:
        """POST JSON; the decoded answer. HTTP errors raise `urllib.error.HTTPError`."""
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 8) -> dict[str, Any]:
        """Greedy `/generate` of `input_ids` through the gateway: the worker's answer
        (`output_ids`, `meta_info` with `id` and `cached_tokens`)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True}}
        if self.model is not None and self.router == "smg":  # SMG routes by the model named
            body["model"] = str(self.model)
        out = self.post("/generate", body)
        return dict(out[0] if isinstance(out, list) else out)  # SMG answers a batch of one

    def flush_cache(self) -> None:
        """Every worker's device prefix cache flushed (kvtier's tiers keep theirs)."""
        req = urllib.request.Request(f"{self.url}/flush_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
