"""LMCache config files in kvtier: what each LMCache key means here, and the LMCache value forms
kvtier translates.

Every key of every released LMCache engine config is in `kvtier.config.lmcache.keys.KEYS` (the
sources are listed there), with one of three statuses:

1. `same`: a kvtier key with the same meaning (a field of `kvtier.config.Config`);
2. `ignored`: accepted and listed in the load warning with why, and what kvtier does instead;
3. `unsupported`: storage or transfer kvtier does not have (PD/NIXL, P2P, GDS, Weka, CXL,
   storage plugins): accepted and listed in the warning with what to use instead. A file whose
   only storage it is leaves kvtier nothing to store in and is refused
   (`unsupported_storage` names the key; the load fails on the empty tier list).

Anything else is an unknown key, a `ConfigError` with the nearest valid key: kvtier stays strict
about keys no LMCache version had. Some values are refused where ignoring them would silently
change what the user gets: a `remote_url` in a scheme kvtier cannot serve
(`UNSUPPORTED_SCHEMES`, with what to use instead), `local_disk` naming several disks.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kvtier.config.lmcache.keys import KEYS, PREFIXES, UNSUPPORTED_SCHEMES, LMCacheKey
from kvtier.errors import ConfigError

__all__ = ["KEYS", "UNIMPLEMENTED", "UNSUPPORTED", "UNSUPPORTED_SCHEMES", "EXTRA_STORAGE",
           "NOT_LMCACHE", "IN_EXAMPLES", "classify", "instead_of", "unknown_hint",
           "unsupported_storage", "Translated", "translate_values", "extra_config_ignored",
           "secret_key"]

# LMCache keys kvtier accepts and ignores -> why, and what kvtier does instead. (The loader
# also suggests the nearest of these for a misspelt key, so storage kvtier lacks is not here.)
UNIMPLEMENTED: dict[str, str] = {k: v.note for k, v in KEYS.items() if v.status == "ignored"}
# LMCache keys for storage or transfer kvtier does not have -> what to use instead.
UNSUPPORTED: dict[str, str] = {k: v.note for k, v in KEYS.items() if v.status == "unsupported"}
# `extra_config` entries that switch on storage kvtier does not have (LMCache 0.3.10-).
EXTRA_STORAGE = {"enable_nixl_storage": ("not supported: no NIXL storage backend: use "
                                          "local_disk: file:///path/ for a file-backed tier")}
# Keys no LMCache version had that turn up in LMCache-style files (another engine's setting, a
# flag of an LMCache example script): errors like any unknown key, with what to use instead.
NOT_LMCACHE: dict[str, str] = {
    "disk_path": "for a disk tier use local_disk: file:///path/ (with max_local_disk_size)",
    "enable_disagg_prefill": ("a vLLM setting, not an LMCache key; kvtier does not do PD "
                              "transfer: drop it and keep local_cpu (instances share KV "
                              "through remote_url: redis://host:6379)"),
}
# Keys no LMCache release reads that LMCache's own example files set (users copy examples):
# accepted and ignored, with a note, like the LMCache key they stand for.
IN_EXAMPLES: dict[str, str] = {
    "async_loading": ("ignored: set by LMCache's RESP example (kv_cache_reuse/remote_backends/"
                      "resp), read by no LMCache release (whose switch is enable_async_loading); "
                      "retrieve() loads synchronously, prefetch_policy loads lower tiers ahead"),
}
_OFF_STRINGS = frozenset({"", "false", "0", "no", "off", "none", "null"})
# Unsupported keys that are sizes, never a place KV is kept.
_NEVER_STORAGE = frozenset({"max_local_cache_size"})


def classify(key: str) -> LMCacheKey | None:
    """The table entry of LMCache key `key` (by name, else by its family's prefix), or None
    when no LMCache version defined it."""
    if key in KEYS:
        return KEYS[key]
    for prefix, entry in PREFIXES.items():
        if key.startswith(prefix):
            return entry
    return None


def instead_of(key: str) -> str | None:
    """The load-warning note of LMCache key `key` ("ignored: why; what kvtier does instead" or
    "not supported: what to use instead"), or of a key LMCache's examples set
    (`IN_EXAMPLES`); None for a kvtier key or any other key no LMCache version had."""
    entry = classify(key)
    if entry is None:
        return IN_EXAMPLES.get(key)
    return None if entry.status == "same" else entry.note


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def unknown_hint(key: str, nearest: str | None) -> str:
    """What to write instead of `key`, a key no LMCache version had: `NOT_LMCACHE`'s line, else
    "did you mean" the closer of the `nearest` kvtier key and the nearest LMCache key kvtier
    ignores, else a pointer to the key list."""
    if key in NOT_LMCACHE:
        return NOT_LMCACHE[key]
    near = difflib.get_close_matches(key, UNIMPLEMENTED, n=1, cutoff=0.6)
    if nearest is not None and (not near or _likeness(key, nearest) >= _likeness(key, near[0])):
        return f"did you mean {nearest!r}?"
    if near:
        return f"did you mean {near[0]!r} (an LMCache key kvtier accepts and ignores)?"
    return "see docs/lmcache.md for every LMCache key and docs/config.md for kvtier's"


def _on(value: Any) -> bool:
    """True if an LMCache value switches its feature on (LMCache's string forms included)."""
    if isinstance(value, str):
        return value.strip().lower() not in _OFF_STRINGS
    return value not in (None, False, 0) and value != [] and value != {}


def _leaves_no_tier(data: Mapping[str, Any]) -> bool:
    local_cpu = data.get("local_cpu", True)
    return not _on(local_cpu) and not _on(data.get("local_disk")) \
        and not _on(data.get("remote_url"))


def unsupported_storage(data: Mapping[str, Any]) -> tuple[str, str] | None:
    """(key, note) of the storage kvtier does not have that the LMCache file `data` keeps its KV
    in, when it keeps it nowhere else: `local_cpu` off, no `local_disk`, no `remote_url`, and an
    `unsupported` key switched on (`extra_config.enable_nixl_storage`, else the first in file
    order). None when the file leaves kvtier a tier, or names no such storage."""
    if not _leaves_no_tier(data):
        return None
    extra = data.get("extra_config")
    if isinstance(extra, Mapping):  # first: its nixl_* top-level keys only size buffers then
        for name, note in EXTRA_STORAGE.items():
            if _on(extra.get(name)):
                return f"extra_config.{name}", note
    for key, value in data.items():
        if key in _NEVER_STORAGE:
            continue
        entry = classify(key)
        if entry is not None and entry.status == "unsupported" and _on(value):
            return key, entry.note
    return None

# What LMCache's remote_serde values become: (the name LMCache gives, kvtier's codec, why).
# CacheGen (a lossy, ~4x smaller codec) is closest to fp8 (lossy, 2x smaller for 16-bit pools,
# gated on quality: docs/codecs.md); the others store raw tensors, as `naive` does.
_SERDE_AS = {
    None: ("null", "naive", "kvtier stores records uncompressed ('naive')"),
    "cachegen": ("cachegen", "fp8", "kvtier stores fp8 records, its closest codec ('fp8': "
                 "one byte a value with per-channel/per-token scales; see docs/codecs.md)"),
    "torch": ("torch", "naive", "kvtier stores records uncompressed ('naive')"),
    "safetensor": ("safetensor", "naive", "kvtier stores records uncompressed ('naive')"),
    "kivi": ("kivi", "naive", "kvtier stores records uncompressed ('naive')"),
}
_CREDENTIAL_KEYS = ("username", "password")
# A key whose name holds one of these words (any case) is taken for a secret: when in doubt a
# value is hidden, never shown. LMCache has no such top-level key today, but extra_config
# entries (`aws_secret_access_key`, `*_auth`, `*credential*`) and unknown keys may carry them.
_SECRET_WORDS = ("auth", "cred", "key", "pass", "secret", "token")
# Secrets whose names hold none of the words: `hash_salt` keys the chunk digests; whoever knows
# it can compute the keys of a guessed prompt and probe a shared tier for it.
_SECRET_NAMES = frozenset({"hash_salt"})
# Known keys that hold a secret word and no secret (token counts, the path of a TLS key file in
# a Redis URL's query); everything else that matches stays hidden.
_NOT_SECRET = frozenset({"prefetch_timeout_per_token_ms", "min_retrieve_tokens",
                         "blend_min_tokens", "ssl_keyfile", "key_namespace",
                         "record_key_file"})


def secret_key(key: str) -> bool:
    """True if a value under `key` must never be shown (logs, CLI output, error messages).

    Matches names holding auth/cred/key/pass/secret/token in any case, and `hash_salt` (also
    as the last part of a dotted name: `extra_config.hash_salt`), except a few known token
    counts (`prefetch_timeout_per_token_ms`). Display only: a secret key loads and is used like
    any other.
    """
    name = key.lower()
    if name in _NOT_SECRET:
        return False
    return (name.rpartition(".")[2] in _SECRET_NAMES
            or any(word in name for word in _SECRET_WORDS))


def extra_config_ignored(extra: Mapping[str, Any]) -> list[str]:
    """The entries of `extra_config` kvtier ignores, as `extra_config.<name>`."""
    return [f"extra_config.{k}" for k in extra if k not in _CREDENTIAL_KEYS]


@dataclass(frozen=True)
class Translated:
    """LMCache values rewritten into kvtier's forms, and one (key, note) per rewrite."""

    values: dict[str, Any]
    notes: tuple[tuple[str, str], ...]


def translate_values(values: Mapping[str, Any], extra: Mapping[str, Any] | None,
                     source: str) -> Translated:
    """Rewrite LMCache value forms in the raw (not yet type-checked) `values`.

    - `remote_serde` null / torch -> "naive" (raw records), cachegen -> "fp8" (its closest);
    - `remote_url` resp:// -> redis:// (LMCache's RESP client speaks to a Redis server);
    - `extra_config` username/password -> the credentials of `remote_url`.

    Raises:
        ConfigError: credentials both in `remote_url` and in `extra_config`, or not strings.
    """
    out = dict(values)
    notes: list[tuple[str, str]] = []
    if "remote_serde" in out and _serde_key(out["remote_serde"]) in _SERDE_AS:
        given, codec, why = _SERDE_AS[_serde_key(out["remote_serde"])]
        out["remote_serde"] = codec
        notes.append(("remote_serde", f"{given}: {why}"))
    url = out.get("remote_url")
    if isinstance(url, str) and url.startswith("resp://"):
        out["remote_url"] = "redis://" + url[len("resp://"):]
        notes.append(("remote_url", "resp:// is read as redis:// (the same RESP protocol)"))
    if extra:
        creds = {k: extra[k] for k in _CREDENTIAL_KEYS if extra.get(k) is not None}
        if creds:
            out["remote_url"], note = _with_credentials(out.get("remote_url"), creds, source)
            notes.append(("extra_config", note))
    return Translated(out, tuple(notes))


def _serde_key(value: Any) -> str | None:
    if value is None:
        return None
    return value.strip().lower() if isinstance(value, str) else "?"


def _with_credentials(url: Any, creds: Mapping[str, Any], source: str) -> tuple[Any, str]:
    for name, value in creds.items():
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ConfigError(f"{source}: extra_config.{name}: must be a string, got "
                              f"{type(value).__name__}")
    if not isinstance(url, str):
        return url, "username/password: unused (no remote_url)"
    scheme, sep, rest = url.partition("://")
    if not sep or "@" in rest.partition("?")[0].partition("/")[0] or (
            scheme == "unix" and "@" in rest):
        raise ConfigError(f"{source}: extra_config.{next(iter(creds))}: remote_url already "
                          "carries credentials; keep them in one place")
    user = quote(str(creds.get("username", "")), safe="")
    password = creds.get("password")
    userinfo = user + (":" + quote(str(password), safe="") if password is not None else "")
    return (f"{scheme}://{userinfo}@{rest}",
            "username/password: used as the credentials of remote_url")
