"""`remote_serde` in the config: kvtier's codecs, LMCache's values and what they become, and
`remote_serde_override` (issue 72; docs/codecs.md)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from harness.redis import RedisProcess
from kvtier.config import load_config
from tests.config.test_lmcache_compat import _round_trip, _with_port


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("serde", ["null", "NULL", "torch"])
def test_remote_serde_lmcache_values_become_naive(tmp_path: Path, serde: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(_write(tmp_path, f"remote_serde: {serde}\n"), env={})
    assert cfg.remote_serde == "naive"
    assert "remote_serde" in caplog.text and "uncompressed" in caplog.text


@pytest.mark.parametrize("serde", ["cachegen", "CacheGen"])
def test_remote_serde_cachegen_becomes_fp8_with_one_warning(
        tmp_path: Path, serde: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(_write(tmp_path, f"remote_serde: {serde}\n"), env={})
    assert cfg.remote_serde == "fp8"
    said = [r for r in caplog.records if "remote_serde" in r.getMessage()]
    assert len(said) == 1 and "cachegen: kvtier stores fp8 records" in said[0].getMessage()


def test_remote_serde_fp8_is_a_kvtier_value(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "remote_serde: fp8\nremote_serde_override: true\n"),
                      env={})
    assert (cfg.remote_serde, cfg.remote_serde_override) == ("fp8", True)
    assert load_config(_write(tmp_path, "chunk_size: 64\n"), env={}).remote_serde_override \
        is False


def test_cachegen_serde_stores_fp8_records(redis_server: RedisProcess, tmp_path: Path) -> None:
    redis_server.client().flushall()
    cfg = load_config(_with_port("redis_cachegen.yaml", tmp_path, redis_server.port), env={})
    assert cfg.remote_serde == "fp8"
    reader, src_layers = _round_trip(cfg, exact=False)
    reader.close()
    client = redis_server.client()
    values = [client.get(k) for k in client.keys("*")]
    raw_k0 = src_layers[0][:256].numpy().tobytes()  # chunk 0, layer 0 K, uncompressed
    assert len(values) == 2 and not any(raw_k0 in v for v in values)
    naive = 2 * 2 * 256 * 16 * 2  # K and V, 2 layers, 256 tokens, 16 values, fp16
    assert all(len(v) < 0.6 * naive for v in values)
