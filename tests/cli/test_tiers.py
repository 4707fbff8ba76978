"""`kvtier tiers` and `kvtier verify` against a server that refuses them as SGLang does: the
error names what to do (launch with `--admin-api-key`, give kvtier the key)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtier.cli import main

ADMIN = "admin-key-for-the-test"


class _SGLangAuth(http.server.BaseHTTPRequestHandler):
    """`/kvtier/tiers` behind SGLang's auth (`sglang.srt.utils.auth.decide_request_auth`): the
    POST is ADMIN_FORCE (403 on a server without an admin key, 401 without that key), the GET
    ADMIN_OPTIONAL (open without keys, else the admin key)."""

    admin_api_key: str | None = None

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        key_ok = self.headers.get("Authorization") == f"Bearer {self.admin_api_key}"
        if self.command == "POST" and not self.admin_api_key:
            status, answer = 403, {"error": "Forbidden"}
        elif self.admin_api_key and not key_ok:
            status, answer = 401, {"error": "Unauthorized"}
        else:
            status, answer = 200, {"success": True, "ranks": [{"tiers": ["cpu"],
                                                              "verify_fraction": 0.05}]}
        raw = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    do_GET = do_POST = _handle

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass


Serve = Callable[[str | None], str]


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Serve]:
    """serve(admin_api_key) -> the URL of a loopback server launched with that key (or none)."""
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "SGLANG_ADMIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(admin_api_key: str | None) -> str:
        handler = type("Handler", (_SGLangAuth,), {"admin_api_key": admin_api_key})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


COMMANDS = [["verify", "--fraction", "0.05"], ["tiers", "detach", "redis"]]


@pytest.mark.parametrize("command", COMMANDS, ids=["verify", "tiers"])
def test_forbidden_says_to_launch_with_an_admin_key(
        serve: Serve, capsys: pytest.CaptureFixture[str], command: list[str],
) -> None:
    url = serve(None)  # launched as the README's quick start does: no --admin-api-key
    assert main([command[0], "--server", url, *command[1:]]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvtier: error:")
    assert "403 Forbidden" in err and "--admin-api-key KEY" in err
    assert "SGLANG_ADMIN_API_KEY" in err and "--admin-key" in err


@pytest.mark.parametrize("command", COMMANDS, ids=["verify", "tiers"])
def test_unauthorized_says_which_key_to_give(
        serve: Serve, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        command: list[str],
) -> None:
    url = serve(ADMIN)
    assert main([command[0], "--server", url, *command[1:]]) == 1
    err = capsys.readouterr().err
    assert "401 Unauthorized" in err and "no admin key was given" in err
    assert "SGLANG_ADMIN_API_KEY" in err and "--admin-api-key" in err
    monkeypatch.setenv("SGLANG_ADMIN_API_KEY", "not-the-key")
    assert main([command[0], "--server", url, *command[1:]]) == 1
    err = capsys.readouterr().err
    assert "401" in err and "is not the server's" in err and "not-the-key" not in err
    monkeypatch.setenv("SGLANG_ADMIN_API_KEY", ADMIN)
    assert main([command[0], "--server", url, *command[1:]]) == 0
    assert "success: true" in capsys.readouterr().out


def test_listing_an_open_server_needs_no_key(serve: Serve,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    url = serve(None)
    assert main(["tiers", "--server", url]) == 0
    assert main(["verify", "--server", url]) == 0
    assert "error" not in capsys.readouterr().err
