"""The disk tier's index on its own: LRU order, the cap, pinned records, mtimes."""

from __future__ import annotations

from kvtier.backends.disk.index import DiskIndex


def _index(capacity: int, *records: tuple[str, int]) -> DiskIndex:
    """An index of `records`, all this tier's own (owner "ns/m", claimed)."""
    index = DiskIndex(capacity)
    index.load((i, name, size) for i, (name, size) in enumerate(records))
    for name, _ in records:
        index.set_owner(name, "ns/m")
    index.claim("ns/m")
    return index


def test_victims_are_least_recently_used_first_and_only_what_the_write_needs() -> None:
    index = _index(100, ("a", 30), ("b", 30), ("c", 30))
    assert index.victims(10) == []  # 90 + 10 fits
    assert index.victims(20) == ["a"]
    index.touch(["a"])
    assert index.victims(20) == ["b"]
    assert index.victims(40) == ["b"]  # 30 over the cap: one record
    assert index.victims(70) == ["b", "c"]


def test_touch_makes_the_first_name_the_most_recent() -> None:
    index = _index(90, ("a", 30), ("b", 30), ("c", 30))
    index.touch(["a", "b"])  # a prefix: "a" is its first chunk, evicted last
    assert index.victims(60) == ["c", "b"]


def test_noted_uses_apply_in_order_before_the_order_is_read() -> None:
    index = _index(90, ("a", 30), ("b", 30), ("c", 30))
    index.note(["b"])  # a faster tier served "b", then the prefix "a", "b"
    index.note(["a", "b"])
    assert index.victims(60) == ["c", "b"]
    index.note(["c"])
    index.put("d", 30)  # a put after the use is newer than it
    assert index.names() == ["b", "a", "c", "d"]
    index.note(["zz"])  # not held: ignored
    index.touch(["b"])
    assert index.names() == ["a", "c", "d", "b"]


def test_a_pinned_record_is_never_a_victim() -> None:
    index = _index(60, ("a", 30), ("b", 30))
    index.pin("a")
    assert index.victims(30) == ["b"]
    index.pin("b")
    assert index.victims(30) is None
    index.unpin("a")
    assert index.victims(30) == ["a"]


def test_a_directory_over_the_cap_is_not_shrunk_by_one_write() -> None:
    index = _index(50, ("a", 30), ("b", 30), ("c", 30))  # 90 bytes under a cap of 50
    assert index.victims(10) == ["a"]  # frees what the write needs, not the 40 over


def test_a_tier_over_its_cap_shrinks_by_a_bounded_multiple_of_each_write() -> None:
    index = _index(50, ("a", 30), ("b", 30), ("c", 30), ("d", 30))  # 120 over a cap of 50
    assert index.victims(10, shrink=4) == ["a", "b"]  # 40 bytes at most, not the 80 over
    assert index.victims(30, shrink=4) == ["a", "b", "c", "d"]  # 100 over: all of it


def test_other_owners_and_unknown_owners_are_never_evicted_nor_counted() -> None:
    index = DiskIndex(60)
    index.load([(0, "theirs", 30), (1, "unknown", 30), (2, "mine", 30)])
    index.set_owner("theirs", "ns/other-model")
    index.set_owner("mine", "ns/m")
    assert index.own_bytes == 0  # nothing claimed yet: nothing may be evicted
    assert index.victims(30) == [] and index.oldest(1000) == []
    index.claim("ns/m")
    assert index.own_bytes == 30  # the cap counts this tier's own records only
    assert index.victims(30) == []  # 30 + 30 fits under 60, whatever the others hold
    assert index.victims(40) == ["mine"]
    assert index.oldest(1000) == ["mine"]
    index.set_owner("unknown", "ns/m")  # identified later, by the background scan
    assert index.own_bytes == 60 and index.victims(30) == ["unknown"]
    index.forget("mine")
    assert index.own_bytes == 30
    index.check()


def test_too_large_and_reserved_bytes() -> None:
    index = _index(100, ("a", 50))
    assert index.victims(101) is None
    index.reserved = 40  # a write in flight
    assert index.victims(20) == ["a"]


def test_put_replaces_adopt_does_not_and_bytes_add_up() -> None:
    index = _index(100, ("a", 30))
    index.put("a", 40)
    assert not index.adopt("a", 99)
    assert index.adopt("b", 10)
    assert (len(index), index.bytes) == (2, 50)
    index.forget("a")
    index.forget("missing")
    assert (len(index), index.bytes, "b" in index) == (1, 10, True)
    index.check()


def test_stamps_are_strictly_decreasing_and_newer_than_any_record_found() -> None:
    index = DiskIndex(100)
    future = 2**62
    index.load([(future, "a", 1)])
    first, second = index.stamps(3), index.stamps(2)
    assert first[0] > first[1] > first[2] > future
    assert min(second) > max(first)


def test_oldest_picks_least_recent_unpinned_records_holding_at_least_the_bytes() -> None:
    index = _index(50, ("a", 30), ("b", 30), ("c", 30))
    assert index.oldest(0) == []
    assert index.oldest(40) == ["a", "b"]  # a shrink to the cap: 90 - 50 over
    index.pin("a")
    assert index.oldest(30) == ["b"]
    assert index.oldest(1000) == ["b", "c"]  # everything that may go


def _tenants_index(share: float) -> DiskIndex:
    """A cap of 100 holding quiet tenant "q"'s 20 bytes (oldest), then noisy "n"'s 80."""
    index = DiskIndex(100, share=share)
    records = [("q1", 10, "q"), ("q2", 10, "q")] + [(f"n{i}", 10, "n") for i in range(8)]
    for name, size, tenant in records:
        index.put(name, size, f"ns/m\0{tenant}")
    index.claim("ns/m\0n")
    return index


def test_a_tenant_over_its_share_loses_its_own_records_first() -> None:
    index = _tenants_index(0.5)
    assert index.tenant_bytes == {"q": 20, "n": 80}
    assert index.victims(20) == ["n0", "n1"]  # "n" holds 80 of a cap of 100, over its 50
    for name in ("n0", "n1"):
        index.forget(name)
    index.put("n8", 10, "ns/m\0n")
    index.put("q3", 10, "ns/m\0q")
    index.check()
    # "n" holds 70, 20 over its share: no more than that comes from it, then plain LRU.
    assert index.victims(30) == ["n2", "n3", "q1"]


def test_without_a_share_or_with_one_tenant_eviction_is_plain_lru() -> None:
    assert _tenants_index(1.0).victims(20) == ["q1", "q2"]
    alone = DiskIndex(100, share=0.5)
    for i in range(10):
        alone.put(f"n{i}", 10, "ns/m\0n")
    alone.claim("ns/m")
    assert alone.victims(20) == ["n0", "n1"]
    alone.check()
