"""The Redis tier's start-up probe: a scratch value on every primary, timed and deleted.

A tier that holds nothing (or only small records) is timed all the same: a lookup of the
scratch name before it exists (one round trip), a `SET` with a TTL, a `GET` read through
kvtier's own reader under the same deadline as record reads, and a `DEL` whatever happened
(the TTL removes it should the `DEL` not get through). Scratch names live inside the tier's
own key prefix, `kvtier/v2/{key_namespace}/`, which a tenant's ACL allows (docs/security.md),
in a component no record has (`probe_prefix`), so no listing, lookup or purge of records sees
them. On a cluster each primary is probed, with a hash tag chosen to land on it: a request's
chunks are read from every primary.
"""

from __future__ import annotations

import os
import secrets
import time

import redis

from kvtier.backends.base import PROBE_PREFIX, ProbeSample
from kvtier.backends.redis.io import pooled_reader
from kvtier.backends.redis.resp import CommandWriter, ReplyError
from kvtier.backends.redis.router import Router
from kvtier.keys import KEY_VERSION

__all__ = ["probe_primaries", "probe_prefix", "PROBE_TTL_S"]

PROBE_TTL_S = 60  # a scratch value outlives a failed DEL by at most this
_TAGS = 1 << 14  # hash tags tried to find a slot on each primary (16384 slots: never short)


def probe_prefix(namespace: str) -> str:
    """Where scratch values of a tier of `namespace` live: inside the namespace's prefix, in
    the model's place, as `@kvtier-probe` (a model's component never starts with `@`)."""
    return f"{KEY_VERSION}/{namespace}/@{PROBE_PREFIX}/"


def probe_primaries(router: Router, nbytes: int, namespace: str) -> list[ProbeSample]:
    """One sample per primary of `router`, scratch names under `probe_prefix(namespace)`
    (see the module docstring)."""
    token = f"{os.getpid()}-{secrets.token_hex(6)}"
    payload = memoryview(bytes(nbytes))
    names = _names(router, probe_prefix(namespace), token)
    return [probe_node(client, name, payload) for client, name in names]


def probe_node(client: redis.Redis, name: str, payload: memoryview) -> ProbeSample:
    """Time a lookup and a read of a scratch value `name` on `client`'s node; deleted after."""
    try:
        start = time.perf_counter()
        _one(client, "EXISTS", name)
        round_trip = time.perf_counter() - start
        if _one(client, "SET", name, payload, "EX", str(PROBE_TTL_S), sent=len(payload)) != b"OK":
            raise ReplyError(f"SET of the probe value {name} was refused")
        start = time.perf_counter()
        got = _read(client, name, len(payload))
        return ProbeSample(round_trip, got, time.perf_counter() - start)
    finally:
        _one(client, "DEL", name)


def _names(router: Router, prefix: str, token: str) -> list[tuple[redis.Redis, str]]:
    want = len(router.primaries())
    found: dict[int, tuple[redis.Redis, str]] = {}
    for tag in range(_TAGS):
        name = f"{prefix}{{{tag}}}/{token}"
        client = router.node_for(name)
        found.setdefault(id(client), (client, name))
        if len(found) == want:
            break
    return list(found.values())


def _one(client: redis.Redis, *command: str | memoryview, sent: int = 0) -> object:
    """One command's small reply (an error reply raised), `sent` bytes charged to its
    deadline as a read's are."""
    reply = _exchange(client, command, sent, None)
    if isinstance(reply, ReplyError):
        raise reply
    return reply


def _read(client: redis.Redis, name: str, nbytes: int) -> int:
    """GET `name` into a scratch buffer; its size."""
    size = _exchange(client, ("GET", name), nbytes, bytearray(nbytes))
    assert isinstance(size, int)
    return size


def _exchange(client: redis.Redis, command: tuple[str | memoryview, ...], nbytes: int,
              into: bytearray | None) -> object:
    """Send `command` and read its reply within the tier's deadline for `nbytes`: a small
    reply, or with `into` a bulk reply read into it (its size returned)."""
    with pooled_reader(client, nbytes) as (conn, reader):
        out = CommandWriter()
        out.command(*command)
        conn.send_packed_command(out.finish(), check_health=False)
        if into is None:
            return reader.reply()
        size = reader.header(b"$") or 0
        if size > len(into):
            raise ReplyError(f"probe value of {size} bytes, {len(into)} written")
        reader.read_into(memoryview(into)[:size])
        reader.end_bulk()
        return size
