"""Encrypted records on the real tiers: byte-exact round trips (Redis segments and disk pieces
included), which reader loads which record (another key, no key, a plain record: a counted
`forged` miss, never deleted), key rotation, and a neighbour tampering with a record."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from harness.redis import RedisProcess
from kvtier.backends import record
from kvtier.backends.base import StorageBackend
from kvtier.backends.redis import backend as redis_backend
from kvtier.backends.redis.io import CipherBuffers
from kvtier.backends.sealing import RecordKeys
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout
from tests.backends.keyed import (
    NEW,
    OLD,
    OTHER,
    Store,
    Tiers,
    close_all,
    loads,
    put_random_records,
    refresh_checksums,
    tier_factory,
)
from tests.backends.redis.redis_helpers import MID
from tests.helpers import make_keys

ID = {s: RecordKeys([s]).current.key_id for s in (NEW, OLD, OTHER)}


@pytest.fixture
def open_store(tmp_path: Path, redis_server: RedisProcess,
               ) -> Iterator[Callable[[str], tuple[Tiers, Store]]]:
    """`open_store(kind)`: a tier factory over the test's one store of `kind` (the Redis
    emptied first), and the store's raw bytes; the tiers are closed and checked after the
    test."""
    opened: list[StorageBackend] = []

    def open_(kind: str) -> tuple[Tiers, Store]:
        if kind == "redis":
            redis_server.client().flushall()
        return tier_factory(kind, tmp_path, redis_server, opened), \
            Store(kind, tmp_path, redis_server)

    yield open_
    close_all(opened)


@pytest.fixture(params=["redis", "disk"])
def store(request: pytest.FixtureRequest,
          open_store: Callable[[str], tuple[Tiers, Store]]) -> tuple[Tiers, Store]:
    return open_store(request.param)


def _key_id(raw: Store, key: ChunkKey) -> bytes:
    data = raw.read(key)
    head = record.parse_header(data, key, KVLayout.mha(2, 2, 8, torch.bfloat16))
    assert head.flags == record.AUTHENTICATED | record.ENCRYPTED
    return head.seal[:4]


# Chunk sizes that walk every path: one piece; Redis segments (0.25 MiB), read with one GET
# each or one MGET; a Redis segment and a disk record larger than the 1 MiB pieces the tiers
# verify at a time (2 MiB chunks, 1.5 MiB segments).
@pytest.mark.parametrize(("kind", "tokens", "segment_mb", "atomic_reads"), [
    ("redis", 16, 1.0, False), ("redis", 16, 0.25, False), ("redis", 16, 0.25, True),
    ("redis", 64, 1.5, False), ("redis", 64, 1.5, True), ("disk", 16, 1.0, False),
    ("disk", 64, 1.0, False)])
def test_encrypted_round_trip_is_byte_exact(open_store: Callable[[str], tuple[Tiers, Store]],
                                            kind: str, tokens: int, segment_mb: float,
                                            atomic_reads: bool) -> None:
    make, raw = open_store(kind)
    extra = ({"remote_segment_mb": segment_mb, "atomic_reads": atomic_reads}
             if kind == "redis" else {})
    tier = make(NEW, layout=MID, **extra)
    keys = make_keys(2 * tokens, chunk_size=tokens, layout=MID)
    want = put_random_records(tier, keys)
    assert loads(tier, keys, want)
    stored = raw.read(keys[0])
    assert len(stored) == record.expected_header_len(keys[0]) + MID.nbytes(tokens)
    plain = want[0].contiguous().view(torch.uint8).numpy().tobytes()
    assert plain[:64] not in stored and plain[-64:] not in stored
    stats = tier.stats()
    assert stats["corrupt"] == 0 and stats.get("rereads", 0) == 0


def test_another_key_or_none_is_a_counted_miss_and_the_record_stays(
        store: tuple[Tiers, Store]) -> None:
    make, raw = store
    owner, stranger, keyless = make(NEW), make(OTHER), make()
    keys = make_keys(48)
    want = put_random_records(owner, keys)
    before = [raw.read(k) for k in keys]
    for reader in (stranger, keyless):
        assert reader.batch_get(keys) == []
        assert reader.stats()["forged"] == 1 and reader.stats()["corrupt"] == 0
    assert [raw.read(k) for k in keys] == before  # nothing deleted, nothing rewritten
    assert loads(owner, keys, want)  # the next reader with the right key loads it
    # And the other way round: a plain record (a writer without the key) is not loaded by a
    # reader holding keys, nor deleted by it.
    plain = put_random_records(keyless, keys, seed=5)
    assert owner.batch_get(keys) == []
    assert owner.stats()["forged"] == 1 and owner.stats()["corrupt"] == 0
    assert loads(keyless, keys, plain)


def test_rotation_reads_the_previous_key_and_writes_the_current(
        store: tuple[Tiers, Store]) -> None:
    make, raw = store
    before, rotated, after = make(OLD), make(NEW, OLD), make(NEW)
    keys = make_keys(32)
    want = put_random_records(before, keys)
    assert _key_id(raw, keys[0]) == ID[OLD]
    assert loads(rotated, keys, want)  # a record of the previous key
    new_keys = make_keys(32, seed=1)
    want_new = put_random_records(rotated, new_keys)
    assert _key_id(raw, new_keys[0]) == ID[NEW]  # written under the current key
    assert loads(after, new_keys, want_new) and loads(before, keys, want)
    assert after.batch_get(keys) == []  # the previous key retired: its records are misses
    assert before.batch_get(new_keys) == []
    for tier in (after, before):
        assert tier.stats()["forged"] == 1
    assert raw.read(keys[0]) and raw.read(new_keys[0])  # and stay


@pytest.mark.parametrize("where", ["ciphertext", "tag", "segment_bytes"])
def test_a_tampered_record_neverloads(store: tuple[Tiers, Store], where: str) -> None:
    """Checksums recomputed (a neighbour): the GCM tag refuses it, a `forged` miss left in
    place. Checksums left as they are (an accident): `corrupt`, deleted."""
    make, raw = store
    tier = make(NEW)
    keys = make_keys(16)
    put_random_records(tier, keys)
    good = bytearray(raw.read(keys[0]))
    hlen = record.header_len(good)
    if where == "ciphertext":
        good[hlen + 7] ^= 0x10
    elif where == "tag":
        good[hlen - 3] ^= 0x01
    else:
        # segment_bytes, 0 -> 1 MiB (still one piece to Redis): only the tag covers it
        struct.pack_into("<I", good, 43, 1 << 20)
    forged = bytes(refresh_checksums(good))
    raw.write(keys[0], forged)
    assert tier.batch_get(keys) == []
    assert tier.stats()["forged"] == 1 and tier.stats()["corrupt"] == 0
    assert raw.read(keys[0]) == forged  # left in place
    broken = bytearray(forged)
    broken[-1] ^= 0x01  # the payload checksum no longer matches: corrupt
    raw.write(keys[0], bytes(broken))
    assert tier.batch_get(keys) == []
    assert tier.stats()["corrupt"] == 1 and raw.read(keys[0]) == b""  # deleted


def test_a_keyless_split_read_of_an_encrypted_record_is_not_reread(
        open_store: Callable[[str], tuple[Tiers, Store]]) -> None:
    """The header alone rules out the load: no second (atomic) read of the segments."""
    make, _ = open_store("redis")
    writer = make(NEW, layout=MID, remote_segment_mb=0.25)
    reader = make(layout=MID, remote_segment_mb=0.25)
    keys = make_keys(32, layout=MID)
    put_random_records(writer, keys)
    assert reader.batch_get(keys) == []
    stats = reader.stats()
    assert stats["forged"] == 1 and stats["rereads"] == 0 and stats["corrupt"] == 0


def test_encrypted_puts_go_in_bounded_groups_from_reused_buffers(
        open_store: Callable[[str], tuple[Tiers, Store]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prefix is sent a group of ciphertext buffers at a time (here one chunk per
    group), and the buffers are kept for the next put, up to the group size."""
    monkeypatch.setattr(redis_backend, "_SEAL_GROUP", MID.nbytes(16))
    sent: list[int] = []
    exchange = redis_backend.rio.exchange

    def counted(client: object, parts: list, counts: list[int]) -> list:  # type: ignore[type-arg]
        sent.append(len(counts))
        return exchange(client, parts, counts)  # type: ignore[arg-type]

    monkeypatch.setattr(redis_backend.rio, "exchange", counted)
    make, _ = open_store("redis")
    tier = make(NEW, layout=MID, remote_segment_mb=0.25)
    keys = make_keys(16 * 5 + 8, layout=MID)  # five chunks and a tail
    want = put_random_records(tier, keys)
    assert sent == [1, 1, 1, 1, 1, 1]  # a round trip per group: here, per record
    assert tier.stats()["puts"] == len(keys) and loads(tier, keys, want)
    pool = tier._buffers  # type: ignore[attr-defined]
    (kept,) = pool._free  # one chunk's worth kept for the next put
    assert len(kept) == MID.nbytes(16)
    assert pool.take(MID.nbytes(8)).obj is kept  # and reused for a smaller record


def test_cipher_buffers_are_reused_best_fit_and_bounded() -> None:
    pool = CipherBuffers(keep=100)
    a, b = pool.take(60), pool.take(30)
    pool.give([a, b])
    assert sorted(len(x) for x in pool._free) == [30, 60]
    small = pool.take(20)
    assert small.obj is b.obj and len(small) == 20  # the smallest that fits
    pool.give([small, pool.take(90)])  # 90 + 60 > 100: the largest are kept, up to keep
    assert [len(x) for x in pool._free] == [90]
    pool.give([pool.take(500)])  # a buffer larger than keep is kept when it is the only one
    assert [len(x) for x in pool._free] == [500]
