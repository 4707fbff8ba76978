"""A running engine forgets one tenant (`kvtier.engine.tenants.forget_tenant`, issue 71 item
3): every chunk that tenant holds in the CPU tier leaves every tier the engine holds, with a
count per tier; the other tenant's chunks and unsalted chunks stay, and the salt never
appears in the log (only its keyed tag)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.engine.tenants import forget_tenant, tag_of_tenant
from kvtier.keys import tag_of_key

CHUNK, LAYERS, HEADS, DIM = 16, 2, 2, 8
CHUNKS = 4
SLOTS = CHUNKS * CHUNK
SALT_A = "tenant-a-secret-salt"
SALT_B = "tenant-b-secret-salt"


def _engine(tmp_path: Path, **values: object) -> CacheEngine:
    gen = torch.Generator().manual_seed(0)
    bufs = [torch.randn(SLOTS, HEADS, DIM, generator=gen) for _ in range(2 * LAYERS)]
    connector = SGLangMHAConnector(bufs[:LAYERS], bufs[LAYERS:])
    cfg = Config(**{"chunk_size": CHUNK, "max_local_cpu_size": 0.01, "save_tails": False,
                    "local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.05,
                    "hash_salt": "fleet-names-salt", **values})  # type: ignore[arg-type]
    return CacheEngine(cfg, model_name="m", layout=connector.layout, connector=connector)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 30_000, (SLOTS,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_forgetting_a_tenant_leaves_the_others_whole(
        tmp_path: Path, fraction: float, caplog: pytest.LogCaptureFixture) -> None:
    slots = torch.arange(SLOTS)
    a1, a2, b, plain = _tokens(1), _tokens(2), _tokens(3), _tokens(4)
    with _engine(tmp_path, tenant_max_fraction=fraction) as eng:
        for tokens, salt in ((a1, SALT_A), (a2, SALT_A), (b, SALT_B), (plain, "")):
            assert eng.store(tokens, slots, salt=salt) == SLOTS
        # The same tokens under tenant B too: same prompt, another tenant's chunks.
        assert eng.store(a1, slots, salt=SALT_B) == SLOTS
        assert eng.flush(30)
        with caplog.at_level(logging.INFO, logger="kvtier"):
            counts = forget_tenant(eng, SALT_A)
        assert counts == {"cpu": 2 * CHUNKS, "disk": 2 * CHUNKS}
        for tokens in (a1, a2):
            assert eng.lookup(tokens, salt=SALT_A) == 0  # no tier has it, the disk included
        for tokens, salt in ((b, SALT_B), (a1, SALT_B), (plain, "")):
            assert eng.lookup(tokens, hot_only=True, salt=salt) == SLOTS
        disk = next(t for t in eng._storage.tiers if t.name == "disk")
        for tokens, salt in ((b, SALT_B), (a1, SALT_B), (plain, "")):
            assert disk.batch_contains(eng.chunk_keys(tokens, salt=salt)) == CHUNKS
        # Forgetting again finds nothing; the log names the tag, never the salt.
        assert forget_tenant(eng, SALT_A) == {"cpu": 0, "disk": 0}
        tag = tag_of_tenant(eng, SALT_A)
        assert {tag_of_key(k.key) for k in eng.chunk_keys(a1, salt=SALT_A)} == {tag}
        assert f"t-{tag}" in caplog.text and SALT_A not in caplog.text


def test_forgetting_a_tenant_the_tier_does_not_hold_changes_nothing(tmp_path: Path) -> None:
    slots = torch.arange(SLOTS)
    with _engine(tmp_path) as eng:
        assert eng.store(_tokens(1), slots, salt=SALT_B) == SLOTS
        assert forget_tenant(eng, SALT_A) == {"cpu": 0, "disk": 0}
        assert eng.lookup(_tokens(1), hot_only=True, salt=SALT_B) == SLOTS


@pytest.mark.parametrize("salt", ["", None, 7])
def test_no_salt_is_refused_by_name(tmp_path: Path, salt: object) -> None:
    with _engine(tmp_path) as eng, pytest.raises(ValueError, match="^tenant: "):
        forget_tenant(eng, salt)  # type: ignore[arg-type]


def test_a_staging_tier_holds_nothing_to_forget(tmp_path: Path) -> None:
    """`local_cpu: false`: a delivered load leaves the staging tier, so the engine finds no
    key of the tenant and its disk records stay for the inventory purge (`kvtier purge
    --tenant`, which deletes them from the config alone)."""
    slots = torch.arange(SLOTS)
    with _engine(tmp_path, local_cpu=False) as eng:
        assert eng.store(_tokens(1), slots, salt=SALT_A) == SLOTS
        assert eng.flush(30)
        assert eng.lookup(_tokens(1), salt=SALT_A) == SLOTS
        assert forget_tenant(eng, SALT_A) == {"staging": 0, "disk": 0}
        assert eng.lookup(_tokens(1), salt=SALT_A) == SLOTS
