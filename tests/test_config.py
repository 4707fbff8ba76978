from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.config import Config, load_config, redact_url
from kvtier.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return path


def test_defaults_without_file() -> None:
    cfg = load_config(env={})
    assert cfg == Config()
    assert cfg.chunk_size == 256 and cfg.tiers == ("cpu",)


def test_lmcache_yaml_loads_unchanged(tmp_path: Path) -> None:
    path = _write(tmp_path, "chunk_size: 64\nlocal_cpu: true\nmax_local_cpu_size: 60.0\n")
    cfg = load_config(path, env={})
    assert (cfg.chunk_size, cfg.local_cpu, cfg.max_local_cpu_size) == (64, True, 60.0)


def test_file_from_env_kvtier_wins_over_lmcache(tmp_path: Path) -> None:
    a = tmp_path / "a.yaml"
    a.write_text("chunk_size: 32\n")
    b = tmp_path / "b.yaml"
    b.write_text("chunk_size: 48\n")
    assert load_config(env={"LMCACHE_CONFIG_FILE": str(b)}).chunk_size == 48
    env = {"KVTIER_CONFIG_FILE": str(a), "LMCACHE_CONFIG_FILE": str(b)}
    assert load_config(env=env).chunk_size == 32


def test_unknown_key_names_file_key_and_nearest(tmp_path: Path) -> None:
    path = _write(tmp_path, "chunk_sise: 64\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    msg = str(err.value)
    assert str(path) in msg and "chunk_sise" in msg and "'chunk_size'" in msg


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("chunk_size: 100\n", "chunk_size"),
        ("chunk_size: 0\n", "chunk_size"),
        ("chunk_size: '64'\n", "chunk_size"),
        ("chunk_size: true\n", "chunk_size"),
        ("max_local_cpu_size: -1\n", "max_local_cpu_size"),
        ("local_cpu: yes please\n", "local_cpu"),
        ("local_disk: /tmp/x\n", "max_local_disk_size"),
        ("write_policy: sometimes\n", "write_policy"),
        ("remote_serde: cachegen\n", "remote_serde"),
        ("local_cpu: false\n", "local_cpu"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=key) as err:
        load_config(path, env={})
    assert str(path) in str(err.value)


def test_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"), env={})


def test_missing_file_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml", env={})


def test_env_overrides_are_strict_and_layered(tmp_path: Path) -> None:
    path = _write(tmp_path, "chunk_size: 64\n")
    env = {"LMCACHE_CHUNK_SIZE": "128", "KVTIER_SAVE_UNFULL_CHUNK": "true",
           "KVTIER_REMOTE_URL": "redis://localhost:1/0"}
    cfg = load_config(path, env=env)
    assert cfg.chunk_size == 128 and cfg.save_unfull_chunk is True
    assert cfg.tiers == ("cpu", "redis")
    assert load_config(path, env={**env, "KVTIER_CHUNK_SIZE": "32"}).chunk_size == 32
    with pytest.raises(ConfigError, match="KVTIER_CHUNK_SIZE"):
        load_config(path, env={"KVTIER_CHUNK_SIZE": "many"})
    with pytest.raises(ConfigError, match="KVTIER_CHUNKSIZE.*chunk_size"):
        load_config(path, env={"KVTIER_CHUNKSIZE": "64"})


def test_other_lmcache_env_is_ignored_with_one_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {"LMCACHE_USE_EXPERIMENTAL": "True", "LMCACHE_LOG_LEVEL": "DEBUG"}
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        cfg = load_config(env=env)
    assert cfg == Config()
    lines = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(lines) == 1 and "LMCACHE_USE_EXPERIMENTAL" in lines[0]


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.chunk_size = 32  # type: ignore[misc]


def test_password_is_redacted() -> None:
    assert redact_url("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("redis://:secret@h:1") == "redis://:***@h:1"
    assert redact_url("redis://h:1") == "redis://h:1"
    cfg = Config(remote_url="redis://u:secret@h:1")
    assert "secret" not in str(cfg.redacted())


def test_kernel_override_is_not_a_config_key() -> None:
    assert load_config(env={"KVTIER_KERNEL": "torch"}) == Config()
