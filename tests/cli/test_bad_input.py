"""Issue 36, item 7: bad input to `kvtier` is one line, `kvtier: error: ...`, exit status 2:
never a traceback, never a hang (missing files, directories and FIFOs for files, bad numbers,
an unreachable or silent Redis, a server that is not kvtier's)."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from harness.redis import free_port
from kvtier.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG_COMMANDS = [["ls"], ["stats"], ["purge", "--yes"], ["check-config"],
                   ["migrate-config"], ["info"], ["bench", "-q"]]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`kvtier args` in this process: (exit status, stderr)."""
    try:
        code = main(args)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


@pytest.fixture(autouse=True)
def _no_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVTIER_CONFIG_FILE", "LMCACHE_CONFIG_FILE", "http_proxy", "HTTP_PROXY",
                 "SGLANG_ADMIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("command", CONFIG_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("kind", ["missing", "directory", "device", "huge"])
def test_a_config_file_that_is_not_one(command: list[str], kind: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = {"missing": tmp_path / "missing.yaml", "directory": tmp_path,
            "device": Path("/dev/null"), "huge": tmp_path / "huge.yaml"}[kind]
    if kind == "huge":  # a valid YAML comment, 2 MiB long: not a config file
        path.write_text("#" * (2 << 20))
    code, err = run([*command, str(path)], capsys)
    assert_one_line_error(code, err, str(path), "cannot read config file")


def test_a_fifo_for_a_file_never_blocks(tmp_path: Path) -> None:
    """In a child process with a deadline: a read of a FIFO would wait for a writer forever."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    for args in (["ls", str(fifo)], ["check-config", str(fifo)],
                 ["tiers", "--server", f"http://127.0.0.1:{free_port()}", "attach", "redis",
                  "--set-file", f"remote_url={fifo}"]):
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli", *args], cwd=ROOT, text=True,
                              capture_output=True, timeout=120)
        assert_one_line_error(proc.returncode, proc.stderr, "not a regular file")


@pytest.mark.parametrize("args, needle", [
    (["check-config", "--tp-size", "abc"], "--tp-size: invalid int value"),
    (["check-config", "--tp-size", "0"], "--tp-size must be >= 1"),
    (["bench", "--prompts", "0"], "--prompts: must be an integer >= 1"),
    (["bench", "--tokens", "-5"], "--tokens: must be an integer >= 1"),
    (["bench", "--tokens", "2k"], "--tokens: must be an integer >= 1"),
    (["ls", "--model"], "--model: expected one argument"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["ls", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["tiers"], "--server"),
    (["tiers", "--server", "not a url"], "must be an http:// or https:// URL"),
    (["tiers", "--server", "http://127.0.0.1:1", "attach", "nowhere"], "invalid choice"),
    (["tiers", "--server", "http://127.0.0.1:1", "attach", "redis", "--set", "novalue"],
     "--set wants KEY=VALUE"),
    (["stats", "--metrics", "not a url"], "cannot read metrics"),
])
def test_bad_arguments_and_numbers(args: list[str], needle: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(*run(args, capsys), needle)


def test_bench_refuses_a_directory_for_its_output_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(*run(["bench", "-q", "--json", str(tmp_path)], capsys),
                          "is a directory")


def _config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"max_local_cpu_size": 0.01, "remote_url": url,
                                    "remote_timeout_secs": 0.5}))
    return path


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never answers (a hung server)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


@pytest.mark.parametrize("command", [["ls"], ["stats"], ["purge", "--yes"]],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("server", ["refused", "silent"])
def test_an_unreachable_redis_is_one_row_within_its_timeout(
        command: list[str], server: str, tmp_path: Path, silent_port: int,
        capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port() if server == "refused" else silent_port
    cfg = _config(tmp_path, f"redis://:secret-pw@127.0.0.1:{port}")
    assert main([*command, str(cfg)]) == 1  # the other tiers were listed: not a usage error
    out = capsys.readouterr()
    down = [line for line in out.out.splitlines() if "DOWN" in line]
    assert len(down) == 1 and down[0].startswith("redis") and "unreachable" in down[0]
    assert "secret-pw" not in out.out + out.err and "Traceback" not in out.err


def test_info_reports_a_silent_redis_as_down(tmp_path: Path, silent_port: int,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(_config(tmp_path, f"redis://127.0.0.1:{silent_port}"))]) == 0
    assert "DOWN" in capsys.readouterr().out


class _NotKvtier(http.server.BaseHTTPRequestHandler):
    """Answers every request 200 with an HTML page, or a JSON list."""

    body = b"<html>hello</html>"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_POST = do_GET

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.mark.parametrize("body", [b"<html>hello</html>", b"[1, 2]", b"not json at all"])
@pytest.mark.parametrize("command", [["tiers"], ["stats", "--metrics"]], ids=lambda c: c[0])
def test_a_server_that_is_not_kvtier(body: bytes, command: list[str],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    handler = type("Handler", (_NotKvtier,), {"body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        code, err = run([*command, *(["--server"] if command == ["tiers"] else []), url],
                        capsys)
    finally:
        server.shutdown()
        server.server_close()
    if command == ["tiers"]:
        assert_one_line_error(code, err, "other than a JSON object")
    else:  # an endpoint with no kvtier estimates: said in one line, status 1
        assert code == 1 and "reports no kvtier estimates" in err and "Traceback" not in err


def test_tiers_on_a_port_nobody_listens_on(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["tiers", "--server", f"http://127.0.0.1:{free_port()}"], capsys)
    assert_one_line_error(code, err, "cannot reach")


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_tiers_set_file_that_cannot_be_read(kind: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "missing" if kind == "missing" else tmp_path
    code, err = run(["tiers", "--server", f"http://127.0.0.1:{free_port()}", "attach",
                     "redis", "--set-file", f"remote_url={path}"], capsys)
    assert_one_line_error(code, err, "--set-file remote_url=", "cannot read")


def test_a_yaml_alias_bomb_is_a_short_error(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 51, item 10: a ~350-byte file of nested aliases expands to megabytes; the error
    names the key and shows the value in part."""
    lines = ["extra_config:", "  x: &a [" + ", ".join(['"xxxxxxxxxx"'] * 9) + "]"]
    for prev, name in zip("abcde", "bcdef"):
        lines.append(f"  {name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join([*lines, "chunk_size: *f", ""]))
    for command in ("check-config", "migrate-config"):
        code = main([command, str(path)])
        out, err = capsys.readouterr()
        assert code == 2 and len(out) + len(err) < 5000, (command, len(out) + len(err))
        assert "chunk_size: must be a int, got list" in err


@pytest.mark.parametrize(("given", "why"), [
    ("file://", "must be a directory path or file:///path URL"),
    ("file://s3://bucket/x", "must be a directory path or file:///path URL"),
    ("/tmp/a\0b", "NUL byte"),
    ("/" + "d" * 2000, "at most 1024"),
])
def test_check_config_refuses_a_local_disk_the_server_would_refuse(
        given: str, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"local_disk": given, "max_local_disk_size": 1}))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "local_disk: " in err and why in err and len(err) < 1000


@pytest.mark.parametrize("root", ["/", "/etc"])
def test_check_config_reports_a_local_disk_the_disk_tier_refuses(
        root: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"local_disk": root, "max_local_disk_size": 1}))
    assert main(["check-config", str(path)]) == 1
    assert f"problem: on this host, local_disk: {root} is" in capsys.readouterr().err
