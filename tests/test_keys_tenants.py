"""Tenant tags in key names: a salted chain's keys carry its tenant's tag, keyed by the names'
secret; unsalted keys keep their format; tagged keys parse as any other."""

from __future__ import annotations

import pytest

from kvtier.keys import KeyBuilder, KeySpace, key_of_redis_name, redis_names, tag_of_key, tenant_tag


def _builder(secret: str = "") -> KeyBuilder:
    return KeyBuilder(model="m", fingerprint="fp", chunk_size=4, salt=secret, tails=True)


def test_salted_keys_carry_their_tenants_tag_and_unsalted_keys_none() -> None:
    ids = list(range(10))
    plain = _builder("names secret").chain(ids)
    assert [tag_of_key(k.key) for k in plain] == [None, None]
    assert all(k.key.count("/") == 6 for k in plain)  # the format of before
    salted = _builder("names secret").chain(ids, "tenant-a")
    tag = tenant_tag("names secret", "tenant-a")
    named = [*salted, *salted.tails(2)]
    assert {tag_of_key(k.key) for k in named} == {tag} and len(tag) == 16
    assert all(f"/t-{tag}/" in k.key and "tenant-a" not in k.key for k in named)
    space, digest = KeySpace.parse(salted[0].key) or (None, "")
    assert space == _builder().space and digest == salted[0].key.rpartition("/")[2]
    names = redis_names(salted[1].key, 2)  # the digest hash-tagged: the tag stays readable
    assert [tag_of_key(n) for n in names] == [tag, tag]
    assert key_of_redis_name(names[1]) == salted[1].key
    # The same tenant under another names secret: another tag (a reader without the secret
    # cannot compute it); other tenants: other tags.
    assert tenant_tag("another secret", "tenant-a") != tag
    assert tenant_tag("names secret", "tenant-b") != tag
    assert tenant_tag("names secret", "") == ""


@pytest.mark.parametrize("key", ["kvtier/v2/ns/m/fp/0of1/t-xyz/ab", "kvtier/v2/ns/m/fp/0of1/ab",
                                 "kvtier/v2/ns/m/fp/0of1/t-0123456789abcdeff/ab"])
def test_what_is_not_a_tag_is_none(key: str) -> None:
    assert tag_of_key(key) is None
