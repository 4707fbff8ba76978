"""A running SGLang server forgets one tenant (issue 71, item 3): `kvtier purge --tenant A
--server URL` asks every TP rank to drop tenant A's chunks from its CPU tier and, under the
same keys, from its disk tier, and prints the counts per rank and tier by A's keyed tag; then A's
prompts miss everywhere while tenant B's (the same prompt among them) and unsalted prompts still
hit, and A's salt appears in no log line. The admin key is required, as for every change.
The per-tenant gauges on SGLang's own `/metrics` (multiprocess mode) are 17 buckets, no more,
and name no salt and no tag."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.sglang_server import SGLangServer
from kvtier.cli import inventory
from kvtier.cli import main as kvtier_main
from kvtier.cli import tiers as cli_tiers
from kvtier.config import load_config
from tests.integration.sglang.conftest import cold, full_hit, prompt, write_config

pytestmark = pytest.mark.sglang

ADMIN = "kvtier-forget-tenant-admin"
SALT_A = "tenant-a-0f3c9e-secret"
SALT_B = "tenant-b-71d2aa-secret"
SHARED, OWN_A, OWN_B, PLAIN = prompt(71), prompt(72), prompt(73), prompt(74)


def _ask(server: SGLangServer, ids: list[int], salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}}
    if salt is not None:
        body["cache_salt"] = salt
    return server.post("/generate", body)


def _records(config: Path, tag: str | None) -> int:
    return sum(g.chunks for x in inventory.survey(load_config(config), tag=tag)
               for g in x.groups)


def _disk_settled(config: Path) -> None:
    """Until the disk holds a steady number of records for 1 s (the writers are done): a
    write still queued at the purge would land after it. At most 60 s (a bound on a hang)."""
    deadline, last, since = time.monotonic() + 60, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = _records(config, None)
        if now != last:
            last, since = now, time.monotonic()
        elif now and time.monotonic() - since >= 1.0:
            return
        time.sleep(0.2)
    raise AssertionError(f"disk records never settled ({last})")


@pytest.fixture(scope="module")
def served(start_server: Callable[..., SGLangServer], tiny_mla: Path,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[SGLangServer, Path]:
    root = tmp_path_factory.mktemp("forget")
    config = write_config(root / "kvtier.yaml", local_disk=str(root / "disk"),
                          max_local_disk_size=0.2, hash_salt="forget-test-names-salt")
    server = start_server(tiny_mla, config, "--page-size", "4", "--tp", "2",
                          "--admin-api-key", ADMIN, "--enable-metrics")
    return server, config


def test_purge_tenant_on_a_server_forgets_it_and_no_other(
        served: tuple[SGLangServer, Path], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    server, config = served
    expected = {tuple(ids): cold(server, ids) for ids in (SHARED, OWN_A, OWN_B, PLAIN)}
    for ids, salt in ((SHARED, SALT_A), (OWN_A, SALT_A), (SHARED, SALT_B), (OWN_B, SALT_B),
                      (PLAIN, None)):
        assert _ask(server, ids, salt)["meta_info"]["cached_tokens"] == 0
    server.flush_cache()  # SGLang's tree emptied; kvtier's stores done
    _disk_settled(config)
    tag_a = _tag_of(capsys, config, SALT_A)
    tag_b = _tag_of(capsys, config, SALT_B)
    assert _records(config, tag_a) > 0 and _records(config, tag_b) > 0
    b_records = _records(config, tag_b)

    # Without the admin key the server refuses (401), and nothing is forgotten.
    status, _ = cli_tiers.request(server.url, {"op": "purge", "tenant": SALT_A}, None)
    assert status == 401
    monkeypatch.setenv("SGLANG_ADMIN_API_KEY", ADMIN)
    assert kvtier_main(["purge", str(config), "--tenant", SALT_A, "--server", server.url,
                        "--yes"]) == 0
    out = capsys.readouterr().out
    ranks = re.findall(r"rank (\d): deleted (\d+) from cpu, (\d+) from disk \(tenant t-(\w+)\)",
                       out)
    assert sorted(r[0] for r in ranks) == ["0", "1"], out
    assert all(int(cpu) > 0 and tag == tag_a for _, cpu, _, tag in ranks), out
    assert sum(int(disk) for _, _, disk, _ in ranks) > 0, out  # the server's own disk index
    assert SALT_A not in out

    assert _records(config, tag_a) == 0
    assert _records(config, tag_b) == b_records
    for ids, salt, hit in ((SHARED, SALT_A, False), (OWN_A, SALT_A, False),
                           (SHARED, SALT_B, True), (OWN_B, SALT_B, True), (PLAIN, None, True)):
        got = _ask(server, ids, salt)
        assert got["meta_info"]["cached_tokens"] == (full_hit(server) if hit else 0), salt
        assert got["output_ids"] == expected[tuple(ids)]
        server.flush_cache()
    assert SALT_A not in server.log() and SALT_B not in server.log()
    assert f"t-{tag_a}" in server.log()


def _tag_of(capsys: pytest.CaptureFixture[str], config: Path, salt: str) -> str:
    """The tenant's tag as `kvtier purge` names it (a purge not confirmed deletes nothing)."""
    capsys.readouterr()
    assert kvtier_main(["purge", str(config), "--tenant", salt]) == 2  # not a terminal
    found = re.search(r"tenant tag t-([0-9a-f]{16})", capsys.readouterr().err)
    assert found is not None
    return found[1]


def _tenant_buckets(server: SGLangServer) -> dict[str, float]:
    """`kvtier_tenant_bytes{tier="cpu"}` per bucket on SGLang's `/metrics`, summed over ranks."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert SALT_A not in text and SALT_B not in text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvtier_tenant_bytes" and s.labels.get("tier") == "cpu":
                bucket = s.labels["tenant_bucket"]
                out[bucket] = out.get(bucket, 0.0) + s.value
    return out


def test_tenant_gauges_on_sglangs_metrics_are_bounded_buckets(
        served: tuple[SGLangServer, Path]) -> None:
    server, _ = served
    for i in range(20):  # 20 more tenants, one prompt each, and an unsalted one
        assert _ask(server, prompt(200 + i, 32), f"many-tenants-{i}")["output_ids"]
    assert _ask(server, prompt(199, 32), None)["output_ids"]
    server.flush_cache()
    deadline, buckets = time.monotonic() + 30, {}  # synced once a second: a bound on a hang
    while time.monotonic() < deadline:
        buckets = _tenant_buckets(server)
        if sum(buckets.values()) > 0:
            break
        time.sleep(0.5)
    assert set(buckets) == {*"0123456789abcdef", "none"}, buckets
    assert sum(buckets.values()) > 0 and buckets["none"] > 0  # the unsalted prompt
