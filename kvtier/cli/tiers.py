"""`kvtier tiers`: list, attach and detach the tiers of a running SGLang server with kvtier.

    kvtier tiers --server http://127.0.0.1:30000                      # list, per TP rank
    kvtier tiers --server URL attach redis [--set remote_timeout_secs=3]
    kvtier tiers --server URL detach redis [--no-drain]

An attach re-attaches a tier the server's config declares (its `remote_url` or `local_disk`),
with only behaviour keys changed; it runs in the background on the server, and this command
waits until every TP rank has it (or none does) and prints the outcome.

Talks to the server's `/kvtier/tiers` route. Attaching and detaching need SGLang's admin key:
the server launched with `--admin-api-key KEY`, the same key in `SGLANG_ADMIN_API_KEY` (or
`--admin-key`); a 401 or 403 is one error line that says so.

Secrets stay out of the process list and off the wire in the clear: `--set-from-env KEY=VAR`
and `--set-file KEY=PATH` take a value from the environment or a file (a `--set` value holding
a password is sent, with a warning); a plain `http://` server that is not loopback is refused
unless `--insecure`; a redirect is never followed (urllib would send the admin key along to
wherever it points).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import stat
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from email.message import Message
from pathlib import Path
from typing import IO, Any, NamedTuple

import yaml

from kvtier.config.lmcache.compat import secret_key
from kvtier.config.tiers import lower_tier_names
from kvtier.config.urls import redact_url
from kvtier.errors import KVTierError

__all__ = ["add_parser", "admin_key", "request", "check_server", "refusal", "TiersError",
           "RedirectRefused"]

ADMIN_KEY_ENV = "SGLANG_ADMIN_API_KEY"
ATTACH_WAIT_S = 120.0  # longer than the server's own attach deadline
REQUEST_TIMEOUT_S = 60.0  # one HTTP request (a detach may drain queued writes first)
MAX_ANSWER_BYTES = 16 << 20
MAX_SET_FILE_BYTES = 1 << 20  # a secret or a URL, not a data file


class TiersError(KVTierError):
    """A `kvtier tiers` command that must not go on (an unsafe server URL, a value source that
    cannot be read); `kvtier.cli.main` prints it and exits 2."""


class RedirectRefused(TiersError):
    """The server answered with a redirect, which is not followed."""

    def __init__(self, url: str, code: int, location: str):
        super().__init__(f"{redact_url(url)} answered {code} redirecting to "
                         f"{redact_url(location)}; not followed, so the admin key is not sent "
                         "there: give --server the URL that answers itself")
        self.code = code
        self.location = location


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Every redirect is a `RedirectRefused`: urllib's own handler re-sends the request's
    headers, `Authorization` included, to whatever host the Location names."""

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: Message, newurl: str) -> urllib.request.Request | None:
        fp.close()
        raise RedirectRefused(req.full_url, code, newurl)


def request(server: str, body: dict[str, Any] | None, admin_key: str | None = None,
            timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """GET (no body) or POST `body` to `server`'s `/kvtier/tiers`; (HTTP status, JSON).

    Does not check `server` (see `check_server`). Raises `RedirectRefused` on a 3xx with a
    Location rather than follow it, `TiersError` on a 2xx that is not a JSON object (not a
    kvtier server); other HTTP errors are returned as (status, JSON body)."""
    url = server.rstrip("/") + "/kvtier/tiers"
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if admin_key:
        headers["Authorization"] = f"Bearer {admin_key}"
    req = urllib.request.Request(url, data=data, headers=headers,
                                 method="GET" if body is None else "POST")
    opener = urllib.request.build_opener(_RefuseRedirects)
    try:
        with opener.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read(MAX_ANSWER_BYTES)
    except urllib.error.HTTPError as exc:
        raw = exc.read(MAX_ANSWER_BYTES)
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            answer = {"error": raw.decode(errors="replace")[:2000]}
        return exc.code, answer
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise TiersError(f"{redact_url(url)} answered {status} with something other than a "
                         "JSON object: is it an SGLang server with kvtier?")
    return status, answer


def _is_loopback(host: str) -> bool:
    """True for `localhost` and addresses in 127.0.0.0/8 or ::1 (names other than localhost
    are not resolved: what they resolve to can change)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_server(server: str, insecure: bool) -> None:
    """`TiersError` unless `server` is an https:// URL, an http:// URL of a loopback host, or
    `insecure` allows plain http:// to another host."""
    parts = urllib.parse.urlsplit(server)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TiersError(f"--server must be an http:// or https:// URL, got "
                         f"{redact_url(server)!r}")
    if parts.scheme == "http" and not insecure and not _is_loopback(parts.hostname):
        raise TiersError(f"refusing plain http:// to {parts.hostname}: the admin key and the "
                         "tier config (with any password in it) would cross the network "
                         "unencrypted; use https://, or pass --insecure on a trusted network")


class _Setting(NamedTuple):
    """One `--set`, `--set-from-env` or `--set-file` in command-line order: `flag` names the
    option, `spec` is the value, the variable name or the path."""

    flag: str
    key: str
    spec: str


def _setting_type(flag: str) -> Callable[[str], _Setting]:
    """The argparse `type` of `flag`: KEY=SPEC into a `_Setting` (only `--set` may have an
    empty value, which is YAML null)."""
    def parse(text: str) -> _Setting:
        key, eq, spec = text.partition("=")
        if not eq or not key or (not spec and flag != "--set"):
            # The text is not echoed: it may be a password typed with ':' for '='.
            raise argparse.ArgumentTypeError(f"{flag} wants KEY=VALUE")
        return _Setting(flag, key, spec)
    return parse


def _password_in_argv(item: _Setting, value: Any) -> bool:
    """True if a `--set` value holds a secret: any value of a secret key (`hash_salt`, ...), or
    a string from which `redact_url` hides something (a userinfo password, `?password=`)."""
    if secret_key(item.key):
        return True
    return isinstance(value, str) and "***" in redact_url(value) and "***" not in value


def _value(item: _Setting) -> Any:
    """The value of one setting: `--set` as YAML (numbers, booleans, null), the others as the
    string they hold (a secret is a string, and YAML would read `yes` or `0123` otherwise)."""
    if item.flag == "--set":
        value = yaml.safe_load(item.spec)
        if _password_in_argv(item, value):
            print(f"kvtier: warning: --set {item.key}=...: a secret on the command line is "
                  "visible to every user of this machine in the process list; use "
                  f"--set-from-env {item.key}=VAR or --set-file {item.key}=PATH",
                  file=sys.stderr)
        return value
    if item.flag == "--set-from-env":
        if item.spec not in os.environ:
            raise TiersError(f"--set-from-env {item.key}={item.spec}: environment variable "
                             f"{item.spec} is not set")
        return os.environ[item.spec]
    try:
        st = os.stat(item.spec)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SET_FILE_BYTES:
            reason = "not a regular file" if not stat.S_ISREG(st.st_mode) else \
                f"{st.st_size} bytes, more than a value ({MAX_SET_FILE_BYTES})"
            raise TiersError(f"--set-file {item.key}={item.spec}: cannot read: {reason}")
        text = Path(item.spec).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = (exc.strerror or str(exc)) if isinstance(exc, OSError) else "not UTF-8 text"
        raise TiersError(f"--set-file {item.key}={item.spec}: cannot read: {reason}") from None
    return text.rstrip("\r\n")  # the newline an editor or `echo` leaves is not part of it


def _tier_config(settings: list[_Setting]) -> dict[str, Any]:
    """The config of an attach, each key given once (whichever option gave it)."""
    out: dict[str, Any] = {}
    for item in settings:
        if item.key in out:
            raise TiersError(f"{item.key} is given twice ({item.flag} and an earlier option)")
        out[item.key] = _value(item)
    return out


def refusal(server: str, status: int, answer: dict[str, Any], key_sent: bool) -> str | None:
    """The error line for an admin route's 401 or 403 (what to do about it); None for any
    other status. SGLang answers 403 on a server launched without `--admin-api-key` (its admin
    routes are closed to everyone) and 401 when the request did not carry the admin key."""
    if status not in (401, 403):
        return None
    said = answer.get("error", answer.get("detail"))
    head = f"kvtier: error: {redact_url(server)} answered {status}" + (f" {said}" if said else "")
    give = (f"give kvtier the same key in {ADMIN_KEY_ENV} (or --admin-key, which the process "
            "list shows)")
    if status == 403:
        return (f"{head}: SGLang refuses its admin routes on a server launched without an "
                f"admin key; launch it with --admin-api-key KEY and {give}")
    sent = ("the key given in " + ADMIN_KEY_ENV + " or --admin-key is not the server's"
            if key_sent else f"no admin key was given (neither {ADMIN_KEY_ENV} nor --admin-key)")
    return (f"{head}: {sent}; the server's --admin-api-key is needed (an inference "
            f"--api-key is not enough): {give}")


def admin_key(args: argparse.Namespace) -> str | None:
    if args.admin_key:
        print(f"kvtier: warning: --admin-key is visible to every user of this machine in the "
              f"process list; set {ADMIN_KEY_ENV} instead", file=sys.stderr)
        return str(args.admin_key)
    return os.environ.get(ADMIN_KEY_ENV) or None


def _run(args: argparse.Namespace) -> int:
    body: dict[str, Any] | None = None
    if args.action == "attach":
        body = {"op": "attach", "tier": args.tier, "config": _tier_config(args.settings or [])}
    elif args.action == "detach":
        body = {"op": "detach", "tier": args.tier, "drain": not args.no_drain}
    key = admin_key(args)
    try:
        status, answer = request(args.server, body, key)
        if status == 202:  # an attach runs in the background: wait for its outcome
            op = answer.get("operation")
            if not isinstance(op, dict) or "id" not in op:
                raise TiersError(f"{redact_url(args.server)} accepted the attach without an "
                                 "operation id to follow")
            status, answer = _wait_for(args.server, key, str(op["id"]))
    except (urllib.error.URLError, OSError) as exc:
        print(f"kvtier: error: cannot reach {redact_url(args.server)}: {exc}", file=sys.stderr)
        return 2
    refused = refusal(args.server, status, answer, key_sent=key is not None)
    if refused is not None:
        print(refused, file=sys.stderr)
        return 1
    print(yaml.safe_dump(answer, sort_keys=False), end="")
    return 0 if status == 200 and answer.get("success") else 1


def _wait_for(server: str, admin_key: str | None, op_id: str,
              timeout: float = ATTACH_WAIT_S) -> tuple[int, dict[str, Any]]:
    """Poll the server until attach `op_id` ended; (200, listing) when it attached, else
    (status, listing with `success: false`)."""
    deadline = time.monotonic() + timeout
    while True:
        status, answer = request(server, None, admin_key)
        listed = answer.get("operations")
        ops = [op for op in (listed if isinstance(listed, list) else [])
               if isinstance(op, dict) and str(op.get("id")) == op_id]
        state = ops[0]["state"] if ops else "unknown"
        if state != "building" or time.monotonic() > deadline:
            answer = {**answer, "operation": ops[0] if ops else {"id": op_id, "state": state}}
            answer["success"] = status == 200 and state == "attached"
            return status, answer
        time.sleep(0.2)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tiers", help="list, attach or detach tiers of a running SGLang server")
    p.add_argument("--server", required=True, help="the SGLang server's URL (https://, or "
                   "http:// to a loopback address)")
    p.add_argument("--admin-key", help=f"the server's --admin-api-key, which attach and detach "
                   f"need (better: {ADMIN_KEY_ENV}, which the process list does not show)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plain http:// to a host that is not loopback (the admin key and "
                   "the config cross the network unencrypted)")
    p.add_argument("action", nargs="?", choices=("list", "attach", "detach"), default="list")
    p.add_argument("tier", nargs="?", choices=lower_tier_names())
    p.add_argument("--set", dest="settings", action="append", type=_setting_type("--set"),
                   metavar="KEY=VALUE",
                   help="a kvtier config key for the attached tier, value as YAML (repeatable)")
    p.add_argument("--set-from-env", dest="settings", action="append",
                   type=_setting_type("--set-from-env"), metavar="KEY=ENVVAR",
                   help="a config key whose value (a string) is in environment variable "
                   "ENVVAR: for secrets such as a remote_url with a password (repeatable)")
    p.add_argument("--set-file", dest="settings", action="append",
                   type=_setting_type("--set-file"), metavar="KEY=PATH",
                   help="a config key whose value (a string; trailing newlines dropped) is "
                   "the content of file PATH (repeatable)")
    p.add_argument("--no-drain", action="store_true",
                   help="detach: drop the tier's queued writes instead of writing them")
    p.set_defaults(func=_check_and_run)


def _check_and_run(args: argparse.Namespace) -> int:
    if args.action != "list" and args.tier is None:
        print(f"kvtier: error: tiers {args.action} needs a tier name (disk or redis)",
              file=sys.stderr)
        return 2
    check_server(args.server, args.insecure)
    return _run(args)
