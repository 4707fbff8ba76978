"""Secrets are never shown: config values in logs, CLI output and errors; session ids in logs;
`kvtier tiers` values in argv, over plain http or across a redirect."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvtier.backends import BackendContext
from kvtier.backends.cpu import CPUBackend
from kvtier.cli import main
from kvtier.cli.tiers import TiersError, check_server
from kvtier.config import Config, load_config
from kvtier.config.lmcache.compat import secret_key
from kvtier.config.lmcache.migrate import explain
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.integration.sglang.rank.adapter import SGLangKVTier
from kvtier.memory import MemoryAllocator, lease
from kvtier.metrics import Counters
from kvtier.storage.sessions import SessionPins, session_tag
from tests.helpers import SMALL_MHA, make_keys, make_obj

SALT = "salt-5f1e0c9d"
PASSWORD = "pw-a81c77e2"
TOKEN = "tok-93be4410"
ADMIN = "admin-key-7d21c3"


# --- 1. config secrets ----------------------------------------------------------------------


@pytest.mark.parametrize("key", ["hash_salt", "extra_config.hash_salt", "password", "passwd",
                                 "remote_auth", "S3_AUTH", "aws_access_key_id",
                                 "aws_secret_access_key", "controller_credential_file",
                                 "api_token", "SECRET"])
def test_secret_key_names(key: str) -> None:
    assert secret_key(key)


@pytest.mark.parametrize("key", ["chunk_size", "remote_url", "prefetch_timeout_per_token_ms",
                                 "min_retrieve_tokens", "salt"])
def test_not_secret_key_names(key: str) -> None:
    assert not secret_key(key)


def test_no_kvtier_key_is_masked_by_accident() -> None:
    """Only secrets are masked: with no salt and no URL, the shown config is the config."""
    cfg = Config()
    assert cfg.redacted() == dataclasses.asdict(cfg)


def test_config_log_line_masks_the_salt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"hash_salt: {SALT}\nremote_url: redis://u:{PASSWORD}@127.0.0.1:1/0\n")
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        cfg = load_config(path, env={})
    assert cfg.hash_salt == SALT  # display only: the salt loads as it is
    lines = [r.getMessage() for r in caplog.records if "kvtier config (" in r.getMessage()]
    assert len(lines) == 1
    assert "'hash_salt': '***'" in lines[0] and "u:***@" in lines[0]
    assert SALT not in caplog.text and PASSWORD not in caplog.text
    assert SALT not in repr(cfg)


def test_check_config_masks_secrets_from_the_file_and_the_environment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"chunk_size: 64\nremote_url: redis://:{PASSWORD}@127.0.0.1:1\n"
                    "extra_config:\n  s3_auth: x\n")
    monkeypatch.setenv("KVTIER_HASH_SALT", SALT)
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert data["kvtier_keys"]["hash_salt"] == "***"
    assert data["effective"]["hash_salt"] == "***"
    assert data["effective"]["remote_url"] == "redis://:***@127.0.0.1:1"
    assert data["effective"]["prefetch_timeout_per_token_ms"] == 0.02
    assert SALT not in out and PASSWORD not in out


def test_migrate_config_masks_secrets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(f"chunk_size: 256\nhash_salt: {SALT}\npd_auth: {TOKEN}\n"
                    f"controller_credential_file: {TOKEN}\nremote_url: redis://127.0.0.1:1\n"
                    f"extra_config:\n  password: {PASSWORD}\n  aws_access_key_id: {TOKEN}\n"
                    f"  nested: {{token: {TOKEN}}}\n")
    assert main(["migrate-config", str(path)]) == 0
    out = capsys.readouterr().out
    tail = yaml.safe_load(out.split("credentials masked):", 1)[1])
    assert tail["hash_salt"] == "***" and tail["remote_url"] == "redis://:***@127.0.0.1:1"
    assert SALT not in out and PASSWORD not in out and TOKEN not in out
    shown = {row.key: row.value for row in explain(path).rows}  # the API, too
    assert shown["hash_salt"] == shown["pd_auth"] == shown["controller_credential_file"] == "***"
    assert shown["extra_config.password"] == shown["extra_config.aws_access_key_id"] == "***"
    assert shown["extra_config.nested"] == "{...}"
    assert TOKEN not in str(shown) and SALT not in str(shown)


@pytest.mark.parametrize(("text", "expected"), [
    (f"hash_salt: [{SALT}]\n", "hash_salt: must be a str, got list ***"),
    (f"hash_salt: {{a: {SALT}}}\n", "hash_salt: must be a str, got dict ***"),
    # PyYAML's own message quotes the line; kvtier's gives its position only
    (f'chunk_size: 64\nhash_salt: "{SALT}\nx: [\n', "quoted scalar (line 2, column 12)"),
])
def test_config_errors_do_not_echo_secret_values(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str,
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and SALT not in err


# --- 2. session ids ----------------------------------------------------------------------------


def test_session_ids_are_logged_hashed(caplog: pytest.LogCaptureFixture) -> None:
    sid = "session-6c0ffee1"
    tag = hashlib.sha256(sid.encode()).hexdigest()[:12]
    assert session_tag(sid) == tag
    now = [0.0]
    arena = MemoryAllocator(64 * 4096)
    cpu = CPUBackend(BackendContext(Config(chunk_size=16), SMALL_MHA, arena))
    keys = make_keys(64)
    objs = [make_obj(arena, SMALL_MHA, k.num_tokens, i) for i, k in enumerate(keys)]
    with lease(objs):
        cpu.batch_put(keys, objs)
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        capped = SessionPins(cpu, cap_bytes=1, ttl_s=60.0, counters=Counters())
        capped.pin(sid, keys)  # over the cap: logs that it kept fewer chunks
        idle = SessionPins(cpu, cap_bytes=1 << 20, ttl_s=60.0, counters=Counters(),
                           clock=lambda: now[0])
        idle.pin(sid, keys)
        now[0] = 61.0
        idle.expire()  # logs the TTL unpin
        # A real engine whose session pinned a stored prefix, closed through the adapter.
        pool = [torch.randn(64, 2, 8) for _ in range(2)]
        conn = SGLangMHAConnector(pool[:1], pool[1:])
        engine = CacheEngine(Config(chunk_size=16, max_local_cpu_size=0.01), model_name="m",
                             layout=conn.layout, connector=conn)
        assert engine.store(list(range(32)), torch.arange(32), session_id=sid) == 32
        adapter = SGLangKVTier(engine, page_size=1)
        try:
            adapter.release_session(sid)  # logs the close
        finally:
            adapter.close()
    messages = [r.getMessage() for r in caplog.records]
    for words in ("pins more than", "idle for", "closed"):
        assert any(words in m and tag in m for m in messages), (words, messages)
    assert sid not in caplog.text


# --- 3. kvtier tiers ---------------------------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers as a kvtier server would, or with a redirect when `redirect_to` is set; records
    each request's method, Authorization header and JSON body."""

    seen: list[dict[str, Any]]
    redirect_to: str | None = None

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append({"method": self.command, "auth": self.headers.get("Authorization"),
                          "body": body})
        if self.redirect_to:
            self.send_response(307)
            self.send_header("Location", self.redirect_to + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        answer = json.dumps({"success": True, "ranks": [{"tiers": ["cpu"]}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST = _handle

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # keep the test's stderr for the CLI's own messages


Serve = Callable[..., tuple[str, list[dict[str, Any]]]]


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Serve]:
    """Starts loopback servers: serve(redirect_to=None) -> (URL, the requests it received)."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                 "ALL_PROXY", "SGLANG_ADMIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)  # loopback only, no proxy in between
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(redirect_to: str | None = None) -> tuple[str, list[dict[str, Any]]]:
        seen: list[dict[str, Any]] = []
        handler = type("Handler", (_Recorder,), {"seen": seen, "redirect_to": redirect_to})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", seen

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_tiers_takes_secrets_from_the_environment_and_files(
        serve: Serve, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
) -> None:
    url, seen = serve()
    monkeypatch.setenv("KVTIER_TEST_REDIS", f"redis://:{PASSWORD}@10.0.0.1:6379")
    salt_file = tmp_path / "salt"
    salt_file.write_text(SALT + "\n")
    monkeypatch.setenv("SGLANG_ADMIN_API_KEY", ADMIN)
    assert main(["tiers", "--server", url, "attach", "redis", "--set-from-env",
                 "remote_url=KVTIER_TEST_REDIS", "--set-file", f"hash_salt={salt_file}",
                 "--set", "remote_timeout_secs=3"]) == 0
    assert seen == [{"method": "POST", "auth": f"Bearer {ADMIN}", "body": {
        "op": "attach", "tier": "redis",
        "config": {"remote_url": f"redis://:{PASSWORD}@10.0.0.1:6379", "hash_salt": SALT,
                   "remote_timeout_secs": 3}}}]
    captured = capsys.readouterr()
    assert "warning" not in captured.err
    assert main(["tiers", "--server", url, "attach", "redis", "--set-from-env",
                 "remote_url=KVTIER_TEST_UNSET"]) == 2
    assert "KVTIER_TEST_UNSET is not set" in capsys.readouterr().err and len(seen) == 1


def test_tiers_warns_about_a_password_in_argv(serve: Serve,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    url, seen = serve()
    assert main(["tiers", "--server", url, "attach", "redis", "--set",
                 f"remote_url=redis://:{PASSWORD}@10.0.0.1:6379"]) == 0
    err = capsys.readouterr().err
    assert "warning: --set remote_url=..." in err and "process list" in err
    assert "--set-from-env remote_url=" in err and PASSWORD not in err
    assert seen[0]["body"]["config"]["remote_url"].endswith(f"{PASSWORD}@10.0.0.1:6379")
    assert main(["tiers", "--server", url, "attach", "redis", "--set",
                 "remote_url=redis://10.0.0.1:6379"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_tiers_refuses_plain_http_to_a_host_that_is_not_loopback(
        capsys: pytest.CaptureFixture[str],
) -> None:
    # Refused before any connection is tried (192.0.2.0/24 is TEST-NET-1).
    assert main(["tiers", "--server", "http://192.0.2.7:30000", "attach", "redis", "--set",
                 "remote_url=redis://h:1"]) == 2
    err = capsys.readouterr().err
    assert "refusing plain http:// to 192.0.2.7" in err and "--insecure" in err
    with pytest.raises(TiersError, match="refusing plain http"):
        check_server("http://kvtier.example:30000", insecure=False)
    for server in ("http://127.0.0.1:1", "http://127.8.9.10:1/", "http://[::1]:1",
                   "http://LOCALHOST:1", "https://kvtier.example"):
        check_server(server, insecure=False)
    check_server("http://192.0.2.7:30000", insecure=True)
    with pytest.raises(TiersError, match="must be an http"):
        check_server("ftp://127.0.0.1", insecure=True)


@pytest.mark.parametrize("action", [[], ["attach", "redis", "--set", "remote_timeout_secs=3"]])
def test_tiers_never_sends_the_admin_key_across_a_redirect(
        serve: Serve, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        action: list[str],
) -> None:
    target, at_target = serve()
    source, at_source = serve(redirect_to=target)
    monkeypatch.setenv("SGLANG_ADMIN_API_KEY", ADMIN)
    assert main(["tiers", "--server", source, *action]) == 2
    assert at_source[0]["auth"] == f"Bearer {ADMIN}"  # the server asked for was sent the key
    assert all(r["auth"] is None for r in at_target)  # the one it redirected to was not
    assert at_target == []  # (the redirect is not followed at all)
    err = capsys.readouterr().err
    assert "kvtier: error:" in err and "307" in err
    assert f"{target}/kvtier/tiers" in err and "not followed" in err and ADMIN not in err
