"""Record keys per tenant (a request's salt): a salted record is sealed under a key derived from
the record key and its salt, so it opens for its tenant only; a record moved under another
tenant's name is a counted `forged` miss that stays; unsalted records keep the record key
itself (the derivation is pinned here with the primitives alone); rotation works per tenant."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from harness.redis import RedisProcess
from kvtier.backends import record
from kvtier.backends.base import StorageBackend
from kvtier.backends.disk.files import file_name, record_path
from kvtier.backends.record import (
    DIGEST,
    FIXED_SIZE,
    RecordKeys,
    encode_header,
    open_payload,
    parse_header,
    seal_for,
    verify_payload,
)
from kvtier.keys import ChunkKey, KeyBuilder
from kvtier.memory import MemoryAllocator, lease
from tests.backends.keyed import (
    NEW,
    OLD,
    Store,
    Tiers,
    close_all,
    loads,
    put_random_records,
    refresh_checksums,
    tier_factory,
)
from tests.helpers import SMALL_MHA, make_obj

_ALLOC = MemoryAllocator(1 << 20)


def tenant_keys(salt: str, num_tokens: int = 32, seed: int = 0) -> list[ChunkKey]:
    """The keys of one random prompt (same seed, same prompt) under tenant `salt`."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (num_tokens,), generator=gen)
    kb = KeyBuilder(model="test-model", fingerprint=SMALL_MHA.fingerprint(16), chunk_size=16,
                    save_unfull_chunk=True)
    return kb.keys(tokens, salt)


def _sealed(key: ChunkKey, keys: RecordKeys) -> tuple[bytes, bytes]:
    """A whole record of random payload under `key`; and its plaintext payload."""
    with lease([make_obj(_ALLOC, SMALL_MHA, key.num_tokens, 3)]) as (obj,):
        view = obj.byte_view()
        seal = seal_for(key, obj, keys=keys)
        stored = bytes(seal.update(view, bytearray(len(view))))
        return encode_header(key, obj, seal=seal) + stored, bytes(view)


def _open(buf: bytes, key: ChunkKey, keys: RecordKeys) -> bytes:
    """The plaintext of record `buf` read for `key` (its salt included), or the exception."""
    head = parse_header(buf, key, SMALL_MHA)
    payload = bytearray(buf[head.header_len:])
    verify_payload(head, memoryview(payload), unseal=None, keys=keys)
    return bytes(payload)


def _decrypt_by_hand(buf: bytes, key: ChunkKey, secret: bytes, salt: str) -> bytes:
    """The payload of `buf`, decrypted with the documented derivation and AES-GCM alone."""
    master = HKDF(hashes.SHA256(), 32, salt=None,
                  info=b"kvtier record encryption v1: AES-256-GCM master key").derive(secret)
    if salt:
        info = b"kvtier record encryption v1: tenant master key\0" + \
            hashlib.sha256(salt.encode()).digest()
        master = HKDFExpand(hashes.SHA256(), 32, info=info).derive(master)
    head = parse_header(buf, key, SMALL_MHA)
    key_id, nonce, tag = head.seal[:4], head.seal[4:16], head.seal[16:]
    aes = HKDFExpand(hashes.SHA256(), 32,
                     info=b"kvtier record encryption v1: record key\0" + nonce + head.aad
                     ).derive(master)
    return AESGCM(aes).decrypt(nonce, buf[head.header_len:] + tag, head.aad + key_id)


def test_a_salted_record_opens_for_its_tenant_only() -> None:
    keys = RecordKeys([NEW])
    a = tenant_keys("tenant-a")[0]
    buf, plain = _sealed(a, keys)
    assert _open(buf, a, keys) == plain
    # The same record (same name and header) read for another tenant, or for none: the key
    # differs, so the tag fails, after the header said nothing against it.
    for salt in ("tenant-b", "", "tenant-a "):
        other = a._replace(salt=salt)
        open_payload(parse_header(buf, other, SMALL_MHA), keys)  # no KeyMismatch: same key id
        with pytest.raises(record.ForgedEntry, match="another tenant"):
            _open(buf, other, keys)
    # The key id names the record key, the same for every tenant: it tells no tenant apart.
    b = tenant_keys("tenant-b")[0]
    assert parse_header(_sealed(b, keys)[0], b, SMALL_MHA).seal[:4] == keys.current.key_id
    assert parse_header(buf, a, SMALL_MHA).seal[:4] == keys.current.key_id


def test_the_derivations_are_the_documented_ones() -> None:
    """Unsalted records keep the record key itself (caches written before stay readable); a
    salted one is under HKDF-Expand(master, tenant info || SHA-256(salt))."""
    keys = RecordKeys([NEW])
    plain_key = tenant_keys("")[0]
    buf, plain = _sealed(plain_key, keys)
    assert _decrypt_by_hand(buf, plain_key, NEW, "") == plain
    salted = tenant_keys("tenant-a")[0]
    buf, plain = _sealed(salted, keys)
    assert _decrypt_by_hand(buf, salted, NEW, "tenant-a") == plain
    with pytest.raises(InvalidTag):  # not under the record key itself
        _decrypt_by_hand(buf, salted, NEW, "")


def test_rotation_works_per_tenant() -> None:
    a = tenant_keys("tenant-a")[0]
    old_record, plain = _sealed(a, RecordKeys([OLD]))
    rotated = RecordKeys([NEW, OLD])
    assert _open(old_record, a, rotated) == plain  # the previous key's record, its tenant
    with pytest.raises(record.ForgedEntry):
        _open(old_record, a._replace(salt="tenant-b"), rotated)
    new_record, plain = _sealed(a, rotated)
    assert parse_header(new_record, a, SMALL_MHA).seal[:4] == rotated.current.key_id
    assert _open(new_record, a, RecordKeys([NEW])) == plain
    with pytest.raises(record.KeyMismatch):
        _open(new_record, a, RecordKeys([OLD]))


@pytest.fixture(params=["redis", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path, redis_server: RedisProcess,
          ) -> Iterator[tuple[Tiers, Store]]:
    """A tier factory over one store of the param's kind (the Redis emptied first), and the
    store's raw bytes; the tiers are closed and checked after the test."""
    if request.param == "redis":
        redis_server.client().flushall()
    opened: list[StorageBackend] = []
    yield (tier_factory(request.param, tmp_path, redis_server, opened),
           Store(request.param, tmp_path, redis_server))
    close_all(opened)


def _renamed(data: bytes, to: ChunkKey) -> bytes:
    """Record `data` moved under `to`'s name as a neighbour who can write the store would:
    the key string and token digest in its header replaced, both checksums recomputed."""
    buf = bytearray(data)
    name = to.key.encode()
    assert record.read_key(buf).encode() != name and len(record.read_key(buf)) == len(name)
    buf[FIXED_SIZE:FIXED_SIZE + len(name)] = name
    buf[FIXED_SIZE + len(name):FIXED_SIZE + len(name) + DIGEST] = record.token_digest(to)
    return bytes(refresh_checksums(buf))


def test_a_record_moved_under_another_tenants_name_is_a_forged_miss_and_stays(
        store: tuple[Tiers, Store]) -> None:
    make, raw = store
    tier = make(NEW)
    a, b = tenant_keys("tenant-a"), tenant_keys("tenant-b")  # one prompt, two tenants
    want = put_random_records(tier, a)
    assert raw.read(b[0]) == b""
    moved = _renamed(raw.read(a[0]), b[0])
    if raw.client is None:  # a new file: its fan-out directory may not exist yet
        record_path(raw.root, file_name(b[0].key)).parent.mkdir(parents=True, exist_ok=True)
    raw.write(b[0], moved)
    reader = make(NEW)  # opened after the move: a disk tier indexes the files at start-up
    assert reader.batch_get(b) == []  # B's name, A's record: not B's key
    stats = reader.stats()
    assert stats["forged"] == 1 and stats["corrupt"] == 0
    assert raw.read(b[0]) == moved  # left in place, as every forged record
    assert loads(reader, a, want)  # and A's own record loads for A


def test_tenants_records_round_trip_and_rotate_on_the_tiers(store: tuple[Tiers, Store]) -> None:
    make, raw = store
    before, rotated, after = make(OLD), make(NEW, OLD), make(NEW)
    a, plain = tenant_keys("tenant-a", seed=1), tenant_keys("", seed=1)
    want_a, want_plain = put_random_records(before, a), put_random_records(before, plain, seed=2)
    assert loads(rotated, a, want_a) and loads(rotated, plain, want_plain)
    assert after.batch_get(a) == [] and after.stats()["forged"] == 1  # the old key retired
    a2 = tenant_keys("tenant-a", seed=3)
    want_a2 = put_random_records(rotated, a2)  # written under the current key, for tenant A
    assert loads(after, a2, want_a2)
    assert raw.read(a[0]) and raw.read(a2[0])


def test_every_key_of_a_salted_chain_carries_its_salt() -> None:
    """What the tiers seal by: full chunks, tail candidates, an inner tail and a segment's
    keys all name their tenant; an unsalted chain's keys name none."""
    kb = KeyBuilder(model="m", fingerprint=SMALL_MHA.fingerprint(16), chunk_size=16,
                    tails=True, page_size=4)
    ids = list(range(100, 140))  # two full chunks and 8 tokens after them
    for salt in ("tenant-a", ""):
        chain = kb.chain(ids, salt)
        named = [*chain, *chain.tails(2), *chain.upto(36).tails(2),
                 *kb.chain(ids, salt, segment=True), *kb.keys(ids, salt)]
        inner = kb.inner_tail(ids, chain, 20, salt)
        assert inner is not None and len(chain) == 2 and len(chain.tails(2)) == 2
        assert {k.salt for k in [*named, inner]} == {salt}
