"""How config values may be shown in messages, logs and CLI output: secrets masked, URLs
redacted (`kvtier.config.urls.redact_url`)."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

from kvtier.config.lmcache import compat
from kvtier.config.urls import redact_url

__all__ = ["shown_value", "shown_in_error"]


def shown_value(key: str, value: Any) -> Any:
    """`value` of `key` as it may be shown to users (logs, CLI output).

    A secret key (`lmcache_compat.secret_key`: `hash_salt`, names holding
    auth/cred/key/pass/secret/token) shows `***` unless unset (None or ""); a mapping shows
    `{...}` (its entries may be secrets under innocent-looking keys); a URL shows through
    `redact_url`; anything else as it is.
    """
    if compat.secret_key(key) and value not in (None, ""):
        return "***"
    if isinstance(value, Mapping):
        return "{...}"
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value


def shown_in_error(key: str, value: Any) -> str:
    """`value` of `key` as an error message may echo it: `***` for a secret key, and for
    `remote_url` whatever its type (a URL in a list is not redacted by `redact_url`)."""
    if key == "remote_url" or compat.secret_key(key):
        return "***"
    return brief(value)


_BRIEF = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxtuple, _BRIEF.maxdict = 3, 6, 6, 6
_BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 120, 120, 60


def brief(value: Any) -> str:
    """`repr(value)` cut to a few hundred characters: nested and long values are shown in
    part (a YAML alias bomb a few hundred bytes long expands to megabytes), without ever
    building the whole repr."""
    return _BRIEF.repr(value)
