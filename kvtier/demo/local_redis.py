"""A throwaway redis-server for `kvtier demo`: loopback only, a free port, no persistence, in
its own temporary directory, stopped by its pid. The demo uses one by default when
`redis-server` is on PATH, so its Redis row (a second instance loading what the first stored)
needs no set-up."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

__all__ = ["local_redis", "redis_server_binary"]

START_TIMEOUT_S = 15.0


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def local_redis(binary: str) -> Iterator[str]:
    """Start `binary` on a free loopback port; yields its URL; stops it (by pid) on exit.

    Raises:
        RuntimeError: it exited or did not answer PING within `START_TIMEOUT_S`.
    """
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-redis-") as work:
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", work, "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _answers(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start "
                                       f"(exit code {proc.poll()})")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
