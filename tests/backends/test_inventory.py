"""Every tier with a `RecordInventory` (its table row's `inventory`) sums up what it holds
(`summary`) and deletes one model's records (`delete_model`) the same way: real disk files under
`tmp_path`, a real redis-server (the suite's session fixture, emptied first)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.backends import BackendContext, InventorySummary, RecordInventory, create_backend
from kvtier.config import Config
from kvtier.config.tiers import load_attr, tier_spec
from kvtier.memory import MemoryAllocator
from tests.helpers import SMALL_MHA, make_keys, put_random

INVENTORIED = ["disk", "redis"]


@pytest.fixture(params=INVENTORIED)
def config(request: pytest.FixtureRequest) -> Config:
    if request.param == "disk":
        tmp = request.getfixturevalue("tmp_path")
        return Config(chunk_size=16, max_local_cpu_size=0.01, local_disk=str(tmp / "disk"),
                      max_local_disk_size=0.1)
    server = request.getfixturevalue("redis_server")
    server.client().flushall()  # shared by the session: start each test empty
    return Config(chunk_size=16, max_local_cpu_size=0.01, remote_url=server.url)


@pytest.fixture
def inventory(config: Config) -> Iterator[RecordInventory]:
    (tier,) = [t for t in config.tiers if tier_spec(t).inventory]
    opened: RecordInventory = load_attr(tier_spec(tier).inventory)(config)
    yield opened
    opened.close()


def _store(config: Config, model: str, prompts: int) -> None:
    """`prompts` prompts of 64 tokens (4 chunks each) of `model`, put in the tier itself."""
    (tier,) = [t for t in config.tiers if tier_spec(t).inventory]
    alloc = MemoryAllocator(1 << 20)
    backend = create_backend(tier, BackendContext(config, SMALL_MHA, alloc))
    try:
        for seed in range(prompts):
            keys = make_keys(64, model=model, seed=sum(map(ord, model)) * 100 + seed)
            put_random(backend.batch_put, alloc, SMALL_MHA, keys, seed)
    finally:
        backend.close()
    assert alloc.used_bytes == 0


def test_an_empty_tier_sums_to_nothing(inventory: RecordInventory) -> None:
    assert inventory.summary() == InventorySummary(0, 0, ())


def test_summary_counts_records_bytes_and_models(config: Config,
                                                 inventory: RecordInventory) -> None:
    _store(config, "alpha", 2)
    _store(config, "beta", 3)
    records = list(inventory.records(config.key_namespace))
    summary = inventory.summary()
    assert summary == InventorySummary(20, sum(r.nbytes for r in records), ("alpha", "beta"))
    assert summary.nbytes > 20 * SMALL_MHA.nbytes(16) // 2  # the KV itself, not just names


def test_delete_model_removes_that_model_alone_and_says_what(config: Config,
                                                            inventory: RecordInventory) -> None:
    _store(config, "alpha", 2)
    _store(config, "beta", 3)
    gone = inventory.delete_model("alpha")
    assert len(gone) == 8 and {r.model for r in gone} == {"alpha"}
    assert inventory.summary().records == 12 and inventory.summary().models == ("beta",)
    assert {r.key for r in gone}.isdisjoint(r.key for r in
                                            inventory.records(config.key_namespace))
    assert inventory.delete_model("alpha") == []  # nothing left of it: nothing deleted
    assert inventory.delete_model("gamma") == []


def test_an_empty_model_name_is_refused_before_anything_is_deleted(
        config: Config, inventory: RecordInventory) -> None:
    _store(config, "alpha", 1)
    with pytest.raises(ValueError, match="^model: "):
        inventory.delete_model("")
    assert inventory.summary().records == 4
