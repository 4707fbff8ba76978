"""Remote URLs as kvtier shows and accepts them: the schemes the Redis tier serves, and
`redact_url`, which hides a URL's passwords before it reaches a message, a log or a repr.

A leaf module: the config checks, the Redis tier's URL parser and the CLI all use it, so it
imports nothing of kvtier's beyond `lmcache_compat` (itself a leaf: which key names hold a
secret) and must stay that way, or the config and the Redis tier import each other.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl

from kvtier.lmcache_compat import secret_key

__all__ = ["REMOTE_SCHEMES", "redact_url"]

REMOTE_SCHEMES = ("redis", "rediss", "unix", "redis-sentinel", "redis-cluster")

# A host list after the userinfo: host[:port][,host[:port]...] up to a path, query or fragment.
_HOSTS = re.compile(r"@([A-Za-z0-9._\-\[\]:,%]*)(?=[/?#]|$)")


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***`: in the userinfo and in query parameters
    whose name suggests a secret (`?password=...`).

    Passwords may hold `?`, `#`, `/` or `@`: the userinfo runs up to the last `@` that a host
    list follows, wherever `?` and `#` are. When in doubt this hides too much, never too
    little."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    prefix = ""
    if hosts := list(_HOSTS.finditer(rest)):
        userinfo, rest = rest[:hosts[-1].start()], rest[hosts[-1].start() + 1:]
        user, colon, _ = userinfo.partition(":")
        prefix = f"{user}:***@" if colon and not set(user) & set("/?#") else "***@"
    rest, qmark, query = rest.partition("?")
    rest = prefix + rest
    if qmark:
        parts = [f"{k}=***" if secret_key(k) else f"{k}={v}"
                 for k, v in parse_qsl(query, keep_blank_values=True)]
        query = "&".join(parts)
    return f"{scheme}://{rest}{qmark}{query}"
