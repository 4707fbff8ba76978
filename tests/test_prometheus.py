"""The Prometheus endpoint: text format, one naming scheme, series that move with the work."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from harness.redis import RedisProcess, free_port
from kvtier import prometheus
from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from tests.helpers import SMALL_MHA, os_thread_name

CHUNK = 16



def scrape(port: int) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """(Content-Type, {(sample name, sorted labels): value})."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        ctype, text = resp.headers["Content-Type"], resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return ctype, samples


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[CacheEngine, int]]:
    port = free_port()
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.01, local_disk=str(tmp_path / "d"),
                 max_local_disk_size=0.1, metrics_port=port)
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randn(512, 2, 8, generator=gen).to(SMALL_MHA.dtype) for _ in range(4)]
    with CacheEngine(cfg, model_name="m", layout=SMALL_MHA,
                     connector=SGLangMHAConnector(pool[:2], pool[2:])) as eng:
        yield eng, port


def _listening(port: int) -> set[str]:
    """The local addresses of the sockets listening on TCP `port` (Linux /proc/net)."""
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            addr, _, hex_port = fields[1].partition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr)
                # /proc writes each 32-bit word in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(ipaddress.ip_address(words)))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc/net/tcp")
def test_the_endpoint_listens_on_loopback_only(engine: tuple[CacheEngine, int]) -> None:
    """Issue 36, item 7: the endpoint bound every interface (0.0.0.0) and has no auth."""
    _, port = engine
    assert _listening(port) == {"127.0.0.1"}
    ctype, _ = scrape(port)  # and it answers there
    assert ctype.startswith("text/plain")


def test_endpoint_speaks_prometheus_text_and_series_move(
        engine: tuple[CacheEngine, int]) -> None:
    eng, port = engine
    ctype, before = scrape(port)
    assert ctype.startswith("text/plain")
    ids = torch.arange(1000, 1064)
    assert eng.store(ids, torch.arange(1, 65)) == 64 and eng.flush()
    eng.tiers.remove(eng.chunk_keys(ids), "cpu")
    assert eng.retrieve(ids, torch.arange(100, 164)) == 64
    _, after = scrape(port)

    def moved(name: str, by: float, **labels: str) -> bool:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0) >= by

    assert moved("kvtier_tokens_stored_total", 64)
    assert moved("kvtier_tokens_loaded_total", 64)
    assert moved("kvtier_hit_chunks_total", 4, tier="disk")
    assert moved("kvtier_tier_op_seconds_count", 1, tier="disk", op="put")
    assert moved("kvtier_tier_op_seconds_count", 1, tier="disk", op="get")
    assert after[("kvtier_arena_bytes", ())] >= eng._storage.allocator.size
    assert ("kvtier_entries", (("tier", "disk"),)) in after


def test_every_dashboard_query_names_an_exported_metric(
        engine: tuple[CacheEngine, int], redis_server: RedisProcess) -> None:
    import json
    import re

    eng, port = engine
    eng.tiers.attach("redis", dataclasses.replace(eng.config, remote_url=redis_server.url))
    ids = torch.arange(64)
    eng.store(ids, torch.arange(1, 65), session_id="s")
    assert eng.flush()
    eng.tiers.remove(eng.chunk_keys(ids), "cpu")
    eng.prefetch(ids)
    assert eng.retrieve(ids, torch.arange(100, 164)) == 64
    prometheus.sync()
    _, samples = scrape(port)
    names = {name for name, _ in samples}
    dashboard = json.loads((Path(__file__).resolve().parent.parent / "examples" /
                            "grafana-kvtier.json").read_text())
    from tests.support.metric_docs import undocumented

    missing = undocumented(names)
    assert not missing, f"add these to docs/metrics.md: {missing}"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    for expr in exprs:
        for metric in re.findall(r"\bkvtier_[a-z_]+", expr):
            assert metric in names or f"{metric}_total" in names, (metric, expr)


def test_estimates_are_exported_and_shown_by_kvtier_stats(
        engine: tuple[CacheEngine, int], capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    eng, port = engine
    ids = torch.arange(2000, 2064)
    assert eng.store(ids, torch.arange(1, 65)) == 64 and eng.flush()
    eng.tiers.remove(eng.chunk_keys(ids), "cpu")
    eng.prefill.observe(4096, 2.0, 4096)  # 2048 tokens/s
    assert eng.start_prefetch(ids).wait_done(30)
    _, samples = scrape(port)
    assert samples[("kvtier_est_prefill_tokens_per_second", ())] == pytest.approx(2048)
    assert samples[("kvtier_est_read_bytes_per_second", (("tier", "disk"),))] > 0
    assert ("kvtier_est_latency_seconds", (("tier", "disk"),)) in samples
    assert samples[("kvtier_adaptive_tokens_loaded_total", ())] >= 64

    assert main(["stats", "--metrics", f"http://127.0.0.1:{port}"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == "prefill: 2,048 tokens/s (measured)"
    disk = next(line for line in shown if line.startswith("disk"))
    assert disk.split()[1] == "up" and disk.endswith("measured") and "guessed" not in disk
    assert any(line.split()[0] == "tokens_loaded" and float(line.split()[1].replace(",", ""))
               >= 64 for line in shown)
    assert not any("_created" in line for line in shown)


def test_kvtier_stats_says_a_down_tier_s_speeds_are_guesses(
        engine: tuple[CacheEngine, int], capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    eng, port = engine
    dead = f"redis://127.0.0.1:{free_port()}"  # nothing listens: the tier starts down
    eng.tiers.attach("redis", dataclasses.replace(eng.config, remote_url=dead,
                                                 remote_timeout_secs=0.5))
    assert main(["stats", "--metrics", f"http://127.0.0.1:{port}"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].endswith("(prior, before the first measured prefill)")
    redis = next(line for line in shown if line.startswith("redis"))
    assert redis.split()[1] == "DOWN" and redis.endswith("guessed (not measured yet)")


def test_kvtier_stats_names_an_endpoint_it_cannot_read(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["stats", "--metrics", url]) == 2
    err = capsys.readouterr().err
    assert url in err and err.startswith("kvtier: error: ")


class _NamedCaller:
    """A metrics source that notes the OS name of the thread that refreshes it."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.seen = threading.Event()

    def stats(self) -> dict[str, float]:
        if threading.current_thread().name == "kvtier-metrics":
            self.names.add(os_thread_name())
            self.seen.set()
        return {}


def test_the_refresh_thread_shows_its_name_to_the_os() -> None:
    source = _NamedCaller()
    prometheus.register(source)
    assert source.seen.wait(30), "the refresh thread never ran"
    assert source.names == {"kv-metrics"}


def test_a_rank_whose_metrics_port_passes_65535_serves_without_metrics(
        caplog: pytest.LogCaptureFixture) -> None:
    k = [torch.zeros(16, 1, 8, dtype=torch.float16)]
    conn = SGLangMHAConnector(k, [t.clone() for t in k])
    cfg = Config(chunk_size=16, max_local_cpu_size=0.001, metrics_port=65535)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        engine = CacheEngine(cfg, model_name="m", layout=conn.layout, connector=conn,
                             world_size=2, rank=1)  # metrics_port + 1 = 65536
    engine.close()
    assert "past 65535" in caplog.text
