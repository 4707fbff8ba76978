"""The Redis tier: standalone, TLS, unix socket, Sentinel and Cluster behind one backend.

Configured by `remote_url` (see the url module), `remote_ttl_secs` (on every key),
`remote_timeout_secs` (every socket operation) and `remote_segment_mb` (larger records are
stored in pieces of this size, written and read atomically; see the io module). Instances sharing a
Redis must use the same segment size to share records; a mismatch is a counted miss.

Failures: a wrong password or a URL that cannot work is a `ConfigError` at start. Anything
else (server down or unreachable at start, timeouts) marks the tier down: every call is then an
immediate miss/no-op, counted as `skipped_down`, while the health module probes the server with
backoff and brings the tier back on its own. A record that fails validation is a miss,
counted as `corrupt`, and deleted; when it was read segment by segment (not atomic, see
the io module) it is first read again with one MGET (counted as `rereads`), and a record that passes
then is a hit that ends the batch.

Modules: backend (RedisBackend), url (`remote_url` parsing), router (the redis-py clients), io (the
zero-copy data path and how records are laid out in keys), resp (RESP2 framing) and health
(up/down state and probing). `RedisBackend` is imported lazily, so that importing
kvtier.backends.redis.url (config checks, `kvtier ls/purge`) loads no more than the URL parser.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.backends.redis.backend import RedisBackend

__all__ = ["RedisBackend"]


def __getattr__(name: str) -> Any:
    if name == "RedisBackend":
        from kvtier.backends.redis.backend import RedisBackend

        return RedisBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
