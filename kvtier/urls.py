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

__all__ = ["REMOTE_SCHEMES", "redact_url", "withhold_pieces"]

REMOTE_SCHEMES = ("redis", "rediss", "unix", "redis-sentinel", "redis-cluster")

# A user name shown beside a redacted password: plain characters only, or nothing is shown.
_PLAIN_USER = re.compile(r"[A-Za-z0-9._\-]*")


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***`: in the userinfo and in query parameters
    whose name suggests a secret (`?password=...`).

    By structure, not by pattern: everything between `://` and the last `@` is the userinfo
    (passwords may hold `?`, `#`, `/`, `@`, spaces or any other character), shown as `***`, or
    as `user:***` when the user name is plain. A URL with an `@` but no `://` is `***`
    altogether. When in doubt this hides too much (an `@` in a query hides the host too),
    never too little."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***" if "@" in url else url
    userinfo, at, rest = rest.rpartition("@")
    prefix = ""
    if at:
        user, colon, _ = userinfo.partition(":")
        prefix = f"{user}:***@" if colon and _PLAIN_USER.fullmatch(user) else "***@"
    rest, qmark, query = rest.partition("?")
    rest = prefix + rest
    if qmark:
        parts = [f"{k}=***" if secret_key(k) else f"{k}={v}"
                 for k, v in parse_qsl(query, keep_blank_values=True)]
        query = "&".join(parts)
    return f"{scheme}://{rest}{qmark}{query}"


_QUOTED = re.compile(r"'([^']*)'|\"([^\"]*)\"")


def withhold_pieces(url: str, message: str) -> str:
    """`message` (about `url`) with every quoted piece of `url` past its scheme replaced by
    `'***'` when `url` holds credentials (an `@`): a parser, ours or a library's, may have cut
    a password anywhere and quoted a piece of it as a port, a path or a parameter name."""
    if "@" not in url:
        return message
    body = url.partition("://")[2] or url

    def hide(m: re.Match[str]) -> str:
        piece = m.group(1) if m.group(1) is not None else m.group(2)
        return "'***'" if piece and piece in body else m.group(0)

    return _QUOTED.sub(hide, message)
