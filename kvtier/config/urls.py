"""Remote URLs as kvtier shows them: `redact_url`, which hides a URL's passwords before it
reaches a message, a log or a repr. (Which tier serves which scheme, and its parser:
`kvtier.config.tiers`.)
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl

from kvtier.config.lmcache.compat import secret_key

__all__ = ["URL_PARAMS", "redact_url", "withhold_pieces"]

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
        query = "&".join(_redacted_params(query))
    return f"{scheme}://{rest}{qmark}{query}"


# Query parameter names a remote URL takes (the Redis tier refuses others). After a secret's
# value, a name outside this set may be the rest of a password holding an unescaped `&`:
# it is hidden too.
URL_PARAMS = frozenset({"db", "client_name", "ssl", "ssl_ca_certs", "ssl_certfile",
                        "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname", "ssl_ca_path",
                        "sentinel_username", "sentinel_password", "password", "username"})


def _redacted_params(query: str) -> list[str]:
    out, hiding = [], False
    for name, value in parse_qsl(query, keep_blank_values=True):
        if secret_key(name):
            out.append(f"{name}=***")
            hiding = True
        elif hiding and name not in URL_PARAMS:
            out.append("***")  # a password's `&`-separated rest, as far as can be told
        else:
            out.append(f"{name}={value}")
            hiding = False
    return out


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
