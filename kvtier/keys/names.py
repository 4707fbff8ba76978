"""Key strings and their components: the version prefix, a model's key component, tenant tags
and the Redis names of a record.

Key strings: `kvtier/v2/{namespace}/{model}/{layout}/{rank}of{world}/{digest}`, and a salted
chunk's (a tenant's) `.../{rank}of{world}/t-{tag}/{digest}` (`tenant_tag`). `namespace` is
the operator's (`key_namespace`: tenants apart in Redis ACL patterns, `ls`, `purge`); `model`
is the served model's name, percent-encoded (reversible, so `org/model` and `org--model` stay
apart and `ls --model` takes the name as given), then `@` and a fingerprint of what else makes
its KV differ (weights, revision, quantization, overrides); `layout` names shape and dtype.
Chunking and chained digests are `kvtier.keys.chunks`'.
"""

from __future__ import annotations

import hashlib
import hmac
import urllib.parse

__all__ = ["KEY_VERSION", "ALL_KEYS", "TAG_PREFIX", "tenant_tag", "tag_of_key",
           "model_component", "model_name_of", "redis_names", "key_of_redis_name"]

KEY_VERSION = "kvtier/v2"
ALL_KEYS = f"{KEY_VERSION}/*"  # a glob (Redis SCAN MATCH) over every kvtier key
# Characters a model name keeps as they are; everything else (/, space, #, {, }, @, %, ...)
# is percent-encoded, so the name is one key component, reversibly.
_NAME_SAFE = "-._~+=,"
# Tenant tags (`tenant_tag`): a salted chunk's key names its tenant keyed by the names' secret.
TAG_PREFIX = "t-"
_TAG_HEX = 16
_TAG_LABEL = b"kvtier tenant tag v1\0"


def tenant_tag(names_secret: str, salt: str) -> str:
    """The tag of tenant `salt` (a request's `cache_salt`) under the salt of key names
    `names_secret` ("" for no salt: no tag): 16 hex digits of HMAC-SHA256, keyed by
    `hash_salt` and, with `record_key_file`, a secret derived from the record key
    (`sealing.name_salt`), so an operator finds a tenant's records (`kvtier purge --tenant`)
    while a reader without the key cannot tell whose they are nor test a guessed salt. With
    neither set the tag is a plain hash. Raises ValueError naming `salt` when it is not text."""
    if not salt:
        return ""
    try:
        msg = _TAG_LABEL + salt.encode()
    except UnicodeEncodeError:
        raise ValueError("salt: not encodable as UTF-8") from None
    mac = hmac.new(names_secret.encode(), msg, hashlib.sha256)
    return mac.hexdigest()[:_TAG_HEX]


def tag_of_key(key: str) -> str | None:
    """The tenant tag a key string carries (without `TAG_PREFIX`); None for an unsalted key."""
    prefix, _, _ = key.rpartition("/")
    last = prefix.rpartition("/")[2]
    if not last.startswith(TAG_PREFIX):
        return None
    tag = last[len(TAG_PREFIX):]
    return tag if len(tag) == _TAG_HEX and all(c in "0123456789abcdef" for c in tag) else None


def model_component(name: str, identity: str = "") -> str:
    """A model's key component: `name` percent-encoded, then `@identity` when given (a
    fingerprint, or the HiCache backend's host layout). `ValueError` for an empty name."""
    if not name:
        raise ValueError("model name must not be empty")
    quoted = urllib.parse.quote(name, safe=_NAME_SAFE)
    return f"{quoted}@{identity}" if identity else quoted


def model_name_of(component: str) -> str:
    """The model name a key component was made from (inverse of `model_component`)."""
    return urllib.parse.unquote(component.rpartition("@")[0] or component)


def redis_names(key: str, nseg: int = 1) -> list[str]:
    """The Redis names of a chunk's record stored in `nseg` segments: `prefix/{digest}`, then
    `prefix/{digest}#1`, ... The digest is the hash tag, so a cluster keeps them in one slot."""
    prefix, _, digest = key.rpartition("/")
    main = f"{prefix}/{{{digest}}}"
    return [main] + [f"{main}#{i}" for i in range(1, nseg)]


def key_of_redis_name(name: str) -> str:
    """The key string of a Redis record or segment name; inverse of `redis_names`."""
    main = name.split("#", 1)[0]
    prefix, _, tagged = main.rpartition("/")
    return f"{prefix}/{tagged.strip('{}')}"
