"""Model identity and the launch checks that keep a shared cache clean: keys follow the weights,
not only config.json; random weights never write to a shared tier; a bad record key file stops
the launch (no SGLang needed: these read files and arguments only)."""

from __future__ import annotations

import argparse
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.integration.sglang.launch.flags import check_launch
from kvtier.integration.sglang.launch.identity import model_fingerprint, weights_digest


def _checkpoint(path: Path, seed: int) -> None:
    """A model directory like a fine-tune's: config.json and one safetensors file whose header
    is the same for every seed (names, dtypes, shapes, offsets); only the data differs."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"hidden_size": 64}')
    header = b'{"w":{"dtype":"F32","shape":[65536],"data_offsets":[0,262144]}}'
    data = bytes((seed * 7 + i) % 251 for i in range(262144))
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)


def _args(path: Path, **kw: object) -> SimpleNamespace:
    base = {"model_path": str(path), "revision": None, "quantization": None, "dtype": "auto",
            "json_model_override_args": "{}", "kv_cache_dtype": "auto", "load_format": "auto"}
    return SimpleNamespace(**{**base, **kw})


def test_two_checkpoints_with_one_config_get_different_keys(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "step-1000", seed=1)
    _checkpoint(tmp_path / "step-2000", seed=2)
    a, b = (model_fingerprint(_args(tmp_path / d)) for d in ("step-1000", "step-2000"))
    assert a != b
    assert model_fingerprint(_args(tmp_path / "step-1000")) == a  # deterministic


def test_weights_replaced_in_place_change_the_key(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "m", seed=1)
    before = model_fingerprint(_args(tmp_path / "m"))
    _checkpoint(tmp_path / "m", seed=3)
    assert model_fingerprint(_args(tmp_path / "m")) != before
    assert model_fingerprint(_args(tmp_path / "m", load_format="dummy")) != \
        model_fingerprint(_args(tmp_path / "m"))
    assert weights_digest(str(tmp_path)) is None  # no safetensors here


def test_an_edit_of_one_matrix_changes_the_key_and_bin_checkpoints_count(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 51, item 4: a sample of the weights missed a ROME-style edit (a few bytes away
    from every sample point); every byte is read now, `.bin` files included, and a file's
    digest is cached by its size, mtime and inode."""
    _checkpoint(tmp_path / "base", seed=1)
    _checkpoint(tmp_path / "edited", seed=1)
    weights = tmp_path / "edited" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 16 * 5 + 4096 + 100] ^= 1  # between two of the old sample points
    weights.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    assert weights_digest(str(tmp_path / "base"), cache) != \
        weights_digest(str(tmp_path / "edited"), cache)
    for name, other in (("pytorch_model.bin", b"\1"), ("consolidated.pt", b"\2")):
        _checkpoint(tmp_path / name, seed=1)
        (tmp_path / name / "model.safetensors").unlink()
        (tmp_path / name / name).write_bytes(b"\0" * 1000)
        first = weights_digest(str(tmp_path / name), cache)
        (tmp_path / name / name).write_bytes(other + b"\0" * 999)
        assert first is not None and weights_digest(str(tmp_path / name), cache) != first
    past = 1_000_000_000  # settled files are cached: the next digest reads no weights
    os.utime(weights, ns=(past, past))
    with caplog.at_level("INFO"):
        once = weights_digest(str(tmp_path / "edited"), cache)
        assert "read all" in caplog.text
        caplog.clear()
        assert weights_digest(str(tmp_path / "edited"), cache) == once
        assert "read all" not in caplog.text


def _launch_args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"page_size": 1, "tp_size": 1, "dp_size": 1,
                                 "load_format": "auto", **kw})


def test_random_weights_never_reach_a_shared_tier(tmp_path: Path) -> None:
    shared = Config(max_local_cpu_size=0.01, local_disk=str(tmp_path / "d"),
                    max_local_disk_size=0.01)
    with pytest.raises(ConfigError, match="load-format dummy.*disk"):
        check_launch(shared, _launch_args(load_format="dummy"))
    check_launch(shared, _launch_args())  # real weights: fine
    check_launch(Config(max_local_cpu_size=0.01), _launch_args(load_format="dummy"))


def test_a_bad_record_key_file_stops_the_launch(tmp_path: Path) -> None:
    key = tmp_path / "record.key"
    cfg = Config(max_local_cpu_size=0.01, record_key_file=str(key))
    with pytest.raises(ConfigError, match="record_key_file.*cannot read"):
        check_launch(cfg, _launch_args())
    key.write_bytes(os.urandom(32).hex().encode())
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="record_key_file.*chmod 600"):
        check_launch(cfg, _launch_args())
    key.chmod(0o600)
    check_launch(cfg, _launch_args())
