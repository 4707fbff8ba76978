"""The Redis tier's records listed and deleted from the config alone (`kvtier ls/purge`):
`SCAN MATCH kvtier/v2/{namespace}/*` on every primary (never `KEYS`, which would block the
server), sizes by `STRLEN`, deletes one key per `DEL` (a cluster refuses a DEL across slots)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.backends.inventory import RecordInventory, StoredRecord
from kvtier.backends.redis.probe import probe_prefix
from kvtier.backends.redis.router import Router
from kvtier.backends.redis.url import parse_remote_url
from kvtier.config import Config
from kvtier.config.names import REDIS
from kvtier.keys import ALL_KEYS, key_of_redis_name

__all__ = ["RedisInventory", "SCAN_BATCH"]

logger = logging.getLogger(__name__)

SCAN_BATCH = 1000


class RedisInventory(RecordInventory):
    def __init__(self, config: Config):
        super().__init__(config)
        assert config.remote_url is not None
        self._router = Router(parse_remote_url(config.remote_url), config.remote_timeout_secs)

    def records(self, namespace: str) -> Iterator[StoredRecord]:
        for client in self._router.primaries():
            yield from _scan_node(client, namespace)

    def delete(self, records: Sequence[StoredRecord]) -> list[StoredRecord]:
        by_node: dict[int, tuple[Any, list[str]]] = {}
        for rkey in (rkey for record in records for rkey in record.location):
            client = self._router.node_for(rkey)  # a chunk's segments share a hash tag
            by_node.setdefault(id(client), (client, []))[1].append(rkey)
        for client, node_keys in by_node.values():
            for start in range(0, len(node_keys), SCAN_BATCH):
                pipe = client.pipeline(transaction=False)
                for rkey in node_keys[start:start + SCAN_BATCH]:
                    pipe.delete(rkey)
                pipe.execute()
        return list(records)

    def close(self) -> None:
        self._router.close()


def _scan_node(client: Any, namespace: str) -> Iterator[StoredRecord]:
    """The records of `namespace` on one node. SCAN is not filtered by ACL key patterns, so
    it is asked for this namespace only (`MATCH`): a tenant never lists another's names. A
    record this user may not read (NOPERM) is skipped and counted in a warning; a probe's
    scratch value (`probe_prefix`) is not a record."""
    segments: dict[str, list[str]] = {}  # key string -> its record's Redis names
    # Namespaces are [A-Za-z0-9._-]: nothing in them is a glob character.
    pattern = ALL_KEYS.removesuffix("*") + f"{namespace}/*"
    scratch = probe_prefix(namespace)
    denied = 0
    for raw in client.scan_iter(match=pattern, count=SCAN_BATCH):
        rkey = raw.decode() if isinstance(raw, bytes) else raw
        if rkey.startswith(scratch):
            continue
        segments.setdefault(key_of_redis_name(rkey), []).append(rkey)
    keys = list(segments)
    for start in range(0, len(keys), SCAN_BATCH):
        batch = keys[start:start + SCAN_BATCH]
        pipe = client.pipeline(transaction=False)
        for key in batch:
            for rkey in segments[key]:
                pipe.strlen(rkey)
        sizes = iter(pipe.execute(raise_on_error=False))
        for key in batch:
            lengths = [next(sizes) for _ in segments[key]]
            if any(isinstance(n, Exception) for n in lengths):
                denied += 1
                continue
            yield StoredRecord(REDIS, key, sum(lengths), tuple(segments[key]))
    if denied:
        logger.warning("kvtier: %d records in namespace %r could not be read (ACL: NOPERM, "
                       "or gone); skipped", denied, namespace)
