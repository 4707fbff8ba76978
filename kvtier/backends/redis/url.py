"""Where the Redis tier connects: `remote_url` parsed into a target, and the clients for it.

Schemes: `redis://[user:pass@]host:port[/db]`, `rediss://...` (TLS; `?ssl_ca_certs=...` etc.),
`unix:///path[?db=N]`, `redis-sentinel://[user:pass@]h1:p1,h2:p2/service_name` and
`redis-cluster://[user:pass@]h1:p1,h2:p2`; `resp://` (LMCache's RESP client) is read as
`redis://`.

Sentinel and Cluster take TLS as `?ssl=true` plus the `ssl_*` parameters of `rediss://`; for
Sentinel it applies to the sentinels and to the data nodes alike. The userinfo holds the data
nodes' credentials; the sentinels are asked with `?sentinel_username=...&sentinel_password=...`
(without credentials when those are absent). Query values are percent-decoded (`+` stays `+`).

Parsing never touches the network; every problem is a `ConfigError` naming the redacted URL. A
password sent without TLS to a host that is not loopback, or over TLS that verifies no
certificate, gets one warning per URL. TLS checks the server's host name unless the URL says
`ssl_check_hostname=false` or `ssl_cert_reqs=none` (`_check_hostname`).

The redis-py clients for a parsed target (`Router`) are kvtier.backends.redis.router.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from redis.connection import parse_url

from kvtier.config.tiers import REDIS_SCHEMES
from kvtier.config.urls import redact_url, withhold_pieces
from kvtier.errors import ConfigError

__all__ = ["RedisTarget", "parse_remote_url", "SCHEMES"]

logger = logging.getLogger(__name__)

SCHEMES = REDIS_SCHEMES
_TLS_PARAMS = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
                         "ssl_check_hostname", "ssl_ca_path"})
_SENTINEL_PARAMS = frozenset({"sentinel_username", "sentinel_password"})
_DEFAULT_PORT = {"redis-sentinel": 26379, "redis-cluster": 6379}
# Spellings redis-py's own URL parser reads the same way (it takes anything else as true).
_TRUE, _FALSE = frozenset({"true", "yes", "1"}), frozenset({"false", "no", "0"})
_CERT_REQS = frozenset({"none", "optional", "required"})

_warned: set[str] = set()  # redacted URLs already warned about a clear-text password
_warned_lock = threading.Lock()


@dataclass(frozen=True)
class RedisTarget:
    """A parsed `remote_url`. `kwargs` (credentials included) never appears in a repr."""

    kind: str  # "standalone", "sentinel" or "cluster"
    url: str  # redacted, for messages and logs
    nodes: tuple[tuple[str, int], ...] = ()  # sentinel or cluster seed addresses
    service: str = ""  # the sentinel service name
    kwargs: Mapping[str, Any] = field(default_factory=dict, repr=False)
    # For the SENTINEL queries only: TLS and the sentinels' own credentials.
    sentinel_kwargs: Mapping[str, Any] = field(default_factory=dict, repr=False)


def _bad(url: str, what: str) -> ConfigError:
    return ConfigError(f"remote_url {redact_url(url)!r}: {withhold_pieces(url, what)}")


def _query(url: str, query: str, allowed: frozenset[str]) -> dict[str, str]:
    """The query's parameters (percent-decoded, `+` kept, the last of a repeated name wins);
    a name outside `allowed` is refused."""
    out: dict[str, str] = {}
    after_secret = False
    for part in query.split("&"):
        if not part:
            continue
        raw_name, _, value = part.partition("=")
        name = unquote(raw_name)
        if name not in allowed:
            # After a password, an unknown name is likely the rest of that password (an
            # unescaped `&`): it is not shown.
            shown = "(hidden: it follows a password; percent-encode '&' in passwords as %26)" \
                if after_secret else repr(name)
            raise _bad(url, f"unsupported query parameter {shown}; supported: "
                            f"{sorted(allowed)} (timeouts come from remote_timeout_secs)")
        after_secret = "password" in name
        out[name] = unquote(value)
    return out


def _flag(url: str, name: str, value: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _bad(url, f"{name} must be true or false, got {value!r}")


def _tls_kwargs(url: str, params: Mapping[str, str]) -> dict[str, Any]:
    """The `ssl_*` parameters as redis-py's connection arguments, checked."""
    out: dict[str, Any] = {}
    for name in sorted(_TLS_PARAMS & params.keys()):
        value = params[name]
        if name == "ssl_check_hostname":
            out[name] = _flag(url, name, value)
        elif name == "ssl_cert_reqs":
            if value not in _CERT_REQS:
                raise _bad(url, f"ssl_cert_reqs must be one of {sorted(_CERT_REQS)}, "
                                f"got {value!r}")
            out[name] = value
        elif not value:
            raise _bad(url, f"{name} needs a path")
        else:
            out[name] = value
    return out


def _check_hostname(tls_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`tls_kwargs` of a TLS connection with `ssl_check_hostname` set explicitly: True unless the
    URL says otherwise. redis-py checked host names by default only from 6.0 (5.x: off, so a
    certificate of any host the CA signed was accepted), and a cluster passes the setting on to
    its nodes only from 6.1; an explicit value holds whatever redis-py is installed. With
    `ssl_cert_reqs=none` there is no certificate to match (and redis-py < 6.1 fails the
    handshake when asked to): False."""
    tls_kwargs.setdefault("ssl_check_hostname", tls_kwargs.get("ssl_cert_reqs") != "none")
    return tls_kwargs


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: not resolved here (parsing never touches the network)
        return False


def _warn_clear_password(target: RedisTarget, hosts: Iterable[str], tls: bool) -> None:
    """One warning per URL when a password would cross the network without TLS, or over TLS
    that verifies no certificate (`ssl_cert_reqs=none`: whoever answers gets it)."""
    has_password = bool(target.kwargs.get("password")
                        or target.sentinel_kwargs.get("password"))
    # Warned about, not refused: ssl_cert_reqs=none is spelled out in the URL by whoever set it
    # (a self-signed server in a private network, a TLS-terminating sidecar), and refusing it
    # would take a running fleet's cache down on an upgrade for a choice the operator made.
    # The warning names the URL (redacted) and the fix, once per URL, at WARNING.
    if tls and has_password and target.kwargs.get("ssl_cert_reqs") == "none":
        with _warned_lock:
            if target.url + "#cert" in _warned:
                return
            _warned.add(target.url + "#cert")
        logger.warning("remote_url %r: a password is configured and ssl_cert_reqs=none: TLS "
                       "verifies no certificate, so the password goes to whoever answers at "
                       "that address; drop ssl_cert_reqs=none (and give ssl_ca_certs for a "
                       "private CA)", target.url)
        return
    remote = sorted({h for h in hosts if not _is_loopback(h)})
    if tls or not has_password or not remote:
        return
    with _warned_lock:
        if target.url in _warned:
            return
        _warned.add(target.url)
    fix = "rediss://" if target.kind == "standalone" else "?ssl=true"
    logger.warning("remote_url %r: a password is configured and the connection to %s is not "
                   "TLS: the password crosses the network in clear; use %s (see "
                   "docs/security.md)", target.url, ", ".join(remote), fix)


def _address(url: str, part: str, default_port: int) -> tuple[str, int]:
    if part.startswith("["):  # [ipv6]:port
        host, _, rest = part[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = part.partition(":")
    if not host:
        raise _bad(url, f"empty host in {part!r}")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _bad(url, f"port of {host!r} must be an integer in 1..65535, got {port_text!r}")
    return host, int(port_text)


def _multi_host(url: str, scheme: str) -> RedisTarget:
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    creds, at, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    allowed = frozenset({"client_name", "ssl"}) | _TLS_PARAMS
    if scheme == "redis-sentinel":
        allowed |= _SENTINEL_PARAMS
    params = _query(url, query, allowed)
    tls = _flag(url, "ssl", params["ssl"]) if "ssl" in params else False
    tls_kwargs = _tls_kwargs(url, params)
    if tls_kwargs and not tls:
        raise _bad(url, f"{sorted(tls_kwargs)} given without ssl=true: add ?ssl=true (TLS to "
                        "every node) or drop them")
    if tls:
        tls_kwargs["ssl"] = True
        _check_hostname(tls_kwargs)
    kwargs: dict[str, Any] = {**tls_kwargs}
    if "client_name" in params:
        kwargs["client_name"] = params["client_name"]
    if at:
        user, colon, password = creds.partition(":")
        if user:
            kwargs["username"] = unquote(user)
        if colon:
            kwargs["password"] = unquote(password)
    if not hosts:
        raise _bad(url, "no host:port list")
    nodes = tuple(_address(url, h, _DEFAULT_PORT[scheme]) for h in hosts.split(","))
    if scheme == "redis-sentinel":
        service = unquote(path.strip("/"))
        if not service or "/" in service:
            raise _bad(url, "needs exactly one service name after the hosts, e.g. "
                            "redis-sentinel://h1:26379,h2:26379/mymaster (LMCache takes it "
                            "from REDIS_SERVICE_NAME, default 'redismaster')")
        queries = dict(tls_kwargs)
        if params.get("sentinel_username"):
            queries["username"] = params["sentinel_username"]
        if "sentinel_password" in params:
            queries["password"] = params["sentinel_password"]
        elif "username" in queries:
            raise _bad(url, "sentinel_username needs sentinel_password")
        target = RedisTarget("sentinel", redact_url(url), nodes, service, kwargs, queries)
    else:
        if path.strip("/") not in ("", "0"):
            raise _bad(url, f"a cluster has only database 0, got path {path!r}")
        target = RedisTarget("cluster", redact_url(url), nodes, "", kwargs)
    _warn_clear_password(target, (h for h, _ in nodes), tls)
    return target


def parse_remote_url(url: str) -> RedisTarget:
    """Parse `url` (see the module docstring); `ConfigError` names the URL and the problem."""
    if url.startswith("resp://"):
        url = "redis://" + url[len("resp://"):]
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise _bad(url, f"scheme must be one of {[s + '://' for s in SCHEMES]}")
    if scheme in _DEFAULT_PORT:
        return _multi_host(url, scheme)
    address, _, query = rest.partition("?")
    allowed = frozenset({"db", "client_name"}) | (_TLS_PARAMS if scheme == "rediss" else set())
    # Reject unknown parameters and bad ssl_* values before redis-py sees them.
    params = _query(url, query, allowed)
    tls_kwargs = _tls_kwargs(url, params)
    if scheme == "rediss":
        _check_hostname(tls_kwargs)
    try:
        kwargs = parse_url(url)
    except ValueError as exc:  # redis-py's and urllib's messages name the field, never the URL
        raise _bad(url, str(exc)) from None
    # Our decoding of the values, as for Sentinel and Cluster (redis-py reads `+` as a space).
    kwargs.update(tls_kwargs)
    if "client_name" in params:
        kwargs["client_name"] = params["client_name"]
    if scheme == "unix":
        if not kwargs.get("path"):
            raise _bad(url, "unix:// needs a socket path, e.g. unix:///run/redis.sock")
    else:
        host_part = address.rpartition("@")[2].partition("/")[0]
        if not kwargs.get("host") or not host_part:
            raise _bad(url, "no host")
        db_path = address.rpartition("@")[2].partition("/")[2]
        if db_path and not db_path.isdigit():
            raise _bad(url, f"database must be an integer, got {db_path!r}")
    if not isinstance(kwargs.get("db", 0), int):
        raise _bad(url, f"db must be an integer, got {kwargs['db']!r}")
    target = RedisTarget("standalone", redact_url(url), (), "", kwargs)
    if scheme in ("redis", "rediss"):
        _warn_clear_password(target, [str(kwargs["host"])], tls=scheme == "rediss")
    return target
