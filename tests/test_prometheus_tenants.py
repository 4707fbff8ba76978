"""Metrics per tenant without a label per tenant (issue 71, item 4): the CPU tier's bytes per
tenant summed into 16 buckets by the first hex digit of the tenant's keyed tag, and `none` for
unsalted chunks; 17 series per tier however many tenants, exact sums, no salt and no tag as a
label value; the count of tenants and the most one holds beside them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.redis import free_port
from kvtier import prometheus
from kvtier.backends.sealing import name_salt
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.engine.tenants import forget_tenant
from kvtier.keys import tenant_tag
from kvtier.memory import ALIGN
from tests.helpers import SMALL_MHA
from tests.test_prometheus import scrape

CHUNK = 16
SLOTS = 2 * CHUNK  # two chunks a prompt
NAMES = "tenant-metrics-names-salt"


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[CacheEngine, int]]:
    port = free_port()
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.05, metrics_port=port,
                 hash_salt=NAMES, save_tails=False)
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randn(SLOTS, 2, 8, generator=gen).to(SMALL_MHA.dtype) for _ in range(4)]
    with CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                     connector=SGLangMHAConnector(pool[:2], pool[2:])) as eng:
        yield eng, port


def _store(eng: CacheEngine, seed: int, salt: str) -> None:
    ids = torch.randint(0, 30_000, (SLOTS,), generator=torch.Generator().manual_seed(seed))
    assert eng.store(ids, torch.arange(SLOTS), salt=salt) == SLOTS


def _tenant_series(port: int) -> dict[str, float]:
    prometheus.sync()
    _, samples = scrape(port)
    return {dict(labels)["tenant_bucket"]: value for (name, labels), value in samples.items()
            if name == "kvtier_tenant_bytes" and dict(labels).get("tier") == "cpu"}


def _gauge(port: int, name: str) -> float:
    _, samples = scrape(port)
    return samples[(name, (("tier", "cpu"),))]


def test_bytes_per_bucket_are_exact_and_bounded(engine: tuple[CacheEngine, int]) -> None:
    eng, port = engine
    unit = -(-SMALL_MHA.nbytes(CHUNK) // ALIGN) * ALIGN  # a chunk, as the arena counts it
    salts = [f"tenant-{i}-salt" for i in range(60)]
    held: Counter[str] = Counter()
    for i, salt in enumerate(salts):
        for seed in range(1 + i % 3):  # 1-3 prompts of 2 chunks each
            _store(eng, 1000 * i + seed, salt)
            held[salt] += 2 * unit
    _store(eng, 99_999, "")
    held[""] += 2 * unit
    secret = name_salt(NAMES, None)
    want: Counter[str] = Counter()
    for salt, nbytes in held.items():
        want[tenant_tag(secret, salt)[0] if salt else "none"] += nbytes
    series = _tenant_series(port)
    assert set(series) == set(prometheus.TENANT_BUCKETS)  # 17, whatever the tenants
    assert series == {b: float(want[b]) for b in prometheus.TENANT_BUCKETS}
    assert _gauge(port, "kvtier_tenants") == 61
    assert _gauge(port, "kvtier_tenant_max_bytes") == 6 * unit
    _, samples = scrape(port)
    values = {v for _, labels in samples for _, v in labels}
    tags = {tenant_tag(secret, s) for s in salts}
    assert not values & (set(salts) | tags | {f"t-{t}" for t in tags})


def test_a_forgotten_tenant_leaves_its_bucket(engine: tuple[CacheEngine, int]) -> None:
    eng, port = engine
    _store(eng, 1, "tenant-x")
    _store(eng, 2, "tenant-y")
    secret = name_salt(NAMES, None)
    x, y = tenant_tag(secret, "tenant-x")[0], tenant_tag(secret, "tenant-y")[0]
    before = _tenant_series(port)
    assert before[x] > 0 and before[y] > 0
    forget_tenant(eng, "tenant-x")
    after = _tenant_series(port)
    assert after[x] == (before[x] - before[y] if x == y else 0)
    assert after[y] > 0 and _gauge(port, "kvtier_tenants") == 1
