"""The tier table is the one place tiers are listed: a dict-backed toy tier registered with one
row (no other file touched) is configurable, checked, served by the engine, listed and purged
through the CLI."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
import yaml

from kvtier.backends import BackendContext, RecordInventory, StorageBackend, StoredRecord
from kvtier.cli import main
from kvtier.config import Config, load_config
from kvtier.config import tiers as tier_table
from kvtier.config.tiers import TierSpec
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj
from tests.helpers import SMALL_MHA

SHELF: dict[str, bytes] = {}  # the toy tier's "server": records by key string


class ToyBackend(StorageBackend):
    name = "toy"

    def __init__(self, ctx: BackendContext):
        self.ctx = ctx

    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        return next((i for i, k in enumerate(keys) if k.key not in SHELF), len(keys))

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        out = []
        for key in keys[:self.batch_contains(keys)]:
            obj = self.ctx.allocate(key.num_tokens)
            if obj is None:
                break
            obj.byte_view()[:] = SHELF[key.key]
            out.append(obj)
        return out

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        for key, obj in zip(keys, objs, strict=True):
            SHELF[key.key] = bytes(obj.byte_view())
        return len(keys)

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        return sum(SHELF.pop(k.key, None) is not None for k in keys)

    def stats(self) -> dict[str, float]:
        return {"entries": len(SHELF)}

    def close(self) -> None:
        pass


class ToyInventory(RecordInventory):
    def records(self, namespace: str) -> Iterator[StoredRecord]:
        for key, data in list(SHELF.items()):
            yield StoredRecord("toy", key, len(data), (key,))

    def delete(self, records: Sequence[StoredRecord]) -> list[StoredRecord]:
        return [r for r in records if SHELF.pop(r.key, None) is not None]


TOY = TierSpec("toy", f"{__name__}:ToyBackend", "remote_url", schemes=("toy",),
               inventory=f"{__name__}:ToyInventory")


@pytest.fixture
def toy_tier() -> Iterator[None]:
    saved = list(tier_table.TABLE)
    tier_table.register(TOY)
    SHELF.clear()
    try:
        yield
    finally:
        tier_table.TABLE[:] = saved
        SHELF.clear()


def test_one_row_makes_a_tier_configurable_listable_and_purgeable(
        toy_tier: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"chunk_size": 16, "max_local_cpu_size": 0.01,
                                    "remote_url": "toy://shelf"}))
    assert load_config(path).tiers == ("cpu", "toy")
    assert main(["check-config", str(path)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["tiers"] == "cpu -> toy"

    pool = [torch.randn(200, 2, 8).to(SMALL_MHA.dtype) for _ in range(4)]
    ids = torch.randint(0, 30_000, (64,), generator=torch.Generator().manual_seed(1))
    with CacheEngine(load_config(path), model_name="toy-model", layout=SMALL_MHA,
                     connector=SGLangMHAConnector(pool[:2], pool[2:])) as engine:
        assert engine.store(ids, torch.arange(1, 65)) == 64
        assert engine.flush()
    assert len(SHELF) == 4  # written down to the toy tier, one record a chunk

    assert main(["ls", str(path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1], r[3]) for r in rows] == [("toy", "4", "toy-model")]
    assert main(["purge", str(path), "--yes"]) == 0
    assert "deleted 4 chunks" in capsys.readouterr().out
    assert SHELF == {}


def test_a_row_clashing_with_a_name_or_scheme_is_refused(toy_tier: None) -> None:
    with pytest.raises(ValueError, match="clashes with"):
        tier_table.register(TierSpec("toy", "m:C", "remote_url"))
    with pytest.raises(ValueError, match=r"clashes with \['redis'\]"):
        tier_table.register(TierSpec("other", "m:C", "remote_url", schemes=("rediss",)))


def test_the_table_orders_and_names_the_tiers() -> None:
    assert tier_table.tier_names() == ["cpu", "disk", "redis"]  # fastest first
    assert tier_table.lower_tier_names() == ["disk", "redis"]
    assert tier_table.url_tier("redis-cluster://h:1").name == "redis"  # type: ignore[union-attr]
    assert tier_table.url_tier("s3://bucket") is None
    with pytest.raises(ConfigError, match=r"unknown storage tier 'tape'; valid: \['cpu', "):
        tier_table.tier_spec("tape")
    cfg = Config(local_disk="/tmp/kvtier-tiers-test", max_local_disk_size=1,
                 remote_url="resp://127.0.0.1:1")
    assert cfg.tiers == ("cpu", "disk", "redis")  # resp:// is Redis's too


@pytest.mark.parametrize("spec", tier_table.TABLE, ids=lambda s: s.name)
def test_every_name_in_a_row_resolves(spec: TierSpec) -> None:
    """The rows name classes and parsers by string (imported only when configured): each
    must exist, be of the kind its field says, and the key must be a config key."""
    assert isinstance(tier_table.load_attr(spec.backend), type)
    assert issubclass(tier_table.load_attr(spec.backend), StorageBackend)
    if spec.inventory:
        assert issubclass(tier_table.load_attr(spec.inventory), RecordInventory)
    if spec.url_parser:
        assert callable(tier_table.load_attr(spec.url_parser))
    if spec.check:
        assert callable(tier_table.load_attr(spec.check))
    assert spec.key in Config.__dataclass_fields__
    assert spec.overridable <= set(Config.__dataclass_fields__)
