from __future__ import annotations

import logging
import math
from dataclasses import fields
from pathlib import Path

import pytest

from kvtier.config import Config, load_config, physical_memory_bytes, redact_url
from kvtier.config.schema import TRANSFER_ARENA_GB
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
    path = _write(tmp_path, "chunk_size: 64\nlocal_cpu: true\nmax_local_cpu_size: 6.0\n")
    cfg = load_config(path, env={})
    assert (cfg.chunk_size, cfg.local_cpu, cfg.max_local_cpu_size) == (64, True, 6.0)


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
        ("chunk_size: 'sixty-four'\n", "chunk_size"),
        ("chunk_size: '64.5'\n", "chunk_size"),
        ("chunk_size: 2097152\n", "chunk_size"),
        ("max_local_cpu_size: 5GB\n", "max_local_cpu_size"),
        ("local_cpu: 'maybe'\n", "local_cpu"),
        ("hash_salt: [1]\n", "hash_salt"),
        ("write_queue_chunks: '8'\n", "write_queue_chunks"),  # kvtier's keys stay strict
        ("metrics_port: 0\n", "metrics_port"),
        ("metrics_port: 65536\n", "metrics_port"),
        ("metrics_port: '9400'\n", "metrics_port"),
        ("blocking_timeout_secs: 1.0e12\n", "blocking_timeout_secs"),
        ("remote_timeout_secs: 1.0e12\n", "remote_timeout_secs"),
        ("remote_ttl_secs: 99999999999999\n", "remote_ttl_secs"),
        ("local_disk: 'file://'\nmax_local_disk_size: 1\n", "local_disk"),
        ("local_disk: ''\nmax_local_disk_size: 1\n", "local_disk"),
        ("local_disk: 'file:///a/,file:///b/'\nmax_local_disk_size: 1\n", "local_disk"),
        ("remote_url: 'lm://h:65432'\n", "remote_url"),
        ("remote_url: 'infinistore://h:1'\n", "remote_url"),
        ("remote_url: 'redis://h:notaport'\n", "remote_url"),
        ("remote_url: 'redis-sentinel://h:26379'\n", "remote_url"),
        ("extra_config: [1, 2]\n", "extra_config"),
        ("chunk_size: true\n", "chunk_size"),
        ("max_local_cpu_size: -1\n", "max_local_cpu_size"),
        ("local_cpu: yes please\n", "local_cpu"),
        ("local_disk: /tmp/x\n", "max_local_disk_size"),
        ("write_policy: sometimes\n", "write_policy"),
        ("remote_serde: zstd\n", "remote_serde"),
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
    # A file found through LMCACHE_CONFIG_FILE is an LMCache setup: LMCACHE_<KEY> applies.
    env = {"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_CHUNK_SIZE": "128",
           "KVTIER_SAVE_UNFULL_CHUNK": "true", "KVTIER_REMOTE_URL": "redis://localhost:1/0"}
    cfg = load_config(env=env)
    assert cfg.chunk_size == 128 and cfg.save_unfull_chunk is True
    assert cfg.tiers == ("cpu", "redis")
    assert load_config(env={**env, "KVTIER_CHUNK_SIZE": "32"}).chunk_size == 32
    # An explicit file (a path, KVTIER_CONFIG_FILE): LMCACHE_<KEY> does not override it.
    assert load_config(path, env=env).chunk_size == 64
    with pytest.raises(ConfigError, match="KVTIER_CHUNK_SIZE"):
        load_config(path, env={"KVTIER_CHUNK_SIZE": "many"})


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


@pytest.mark.parametrize("url, secret", [
    ("redis://user:s3cr?et@h:6379", "s3cr"),  # `?` in the password
    ("redis://:a/b#c@h:1/0", "a/b"),  # `/` and `#`
    ("redis://u:p@ss@h1:1,h2:2/0", "p@ss"),  # `@`
    ("redis-sentinel://:x+y/z@s1:26379,s2:26379/mymaster", "x+y"),
    ("rediss://:pw@h:1?ssl_ca_certs=/a@b/c", "pw"),  # `@` in the query: hides too much
])
def test_redact_url_hides_passwords_with_url_characters(url: str, secret: str) -> None:
    redacted = redact_url(url)
    assert secret not in redacted and "***" in redacted
    cfg = Config(remote_url="redis://u:secret@h:1")
    assert "secret" not in str(cfg.redacted())
    assert "secret" not in repr(cfg) and "redis://u:***@h:1" in repr(cfg)


def test_kernel_override_is_not_a_config_key() -> None:
    assert load_config(env={"KVTIER_KERNEL": "torch"}) == Config()


# ---- LMCache value forms --------------------------------------------------------------------

def test_lmcache_numbers_and_booleans_as_strings(tmp_path: Path) -> None:
    path = _write(tmp_path, "chunk_size: '128'\nmax_local_cpu_size: '1.5'\nlocal_cpu: 'True'\n"
                  "save_unfull_chunk: 'false'\nblocking_timeout_secs: ' 30 '\n")
    cfg = load_config(path, env={})
    assert (cfg.chunk_size, cfg.max_local_cpu_size, cfg.local_cpu) == (128, 1.5, True)
    assert (cfg.save_unfull_chunk, cfg.blocking_timeout_secs) == (False, 30.0)


def test_resp_is_redis_and_extra_config_gives_credentials(tmp_path: Path) -> None:
    path = _write(tmp_path, "remote_url: resp://h:6379\nextra_config:\n  username: u s\n"
                  "  password: 'p@ss:w/rd'\n  resp_num_threads: 8\n")
    cfg = load_config(path, env={})
    assert cfg.remote_url == "redis://u%20s:p%40ss%3Aw%2Frd@h:6379"
    from kvtier.backends.redis.url import parse_remote_url

    target = parse_remote_url(cfg.remote_url)
    assert (target.kwargs["username"], target.kwargs["password"]) == ("u s", "p@ss:w/rd")
    assert "p@ss" not in str(cfg.redacted()) and "p%40ss" not in str(cfg.redacted())


def test_credentials_in_url_and_extra_config_conflict(tmp_path: Path) -> None:
    path = _write(tmp_path, "remote_url: redis://a:b@h:1\nextra_config:\n  password: c\n")
    with pytest.raises(ConfigError, match="extra_config.password"):
        load_config(path, env={})


def test_local_cpu_false_with_zero_size_gets_a_transfer_arena(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    path = _write(tmp_path, f"local_cpu: False\nmax_local_cpu_size: 0\nlocal_disk: {tmp_path}\n"
                  "max_local_disk_size: 1\n")
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(path, env={})
    assert cfg.tiers == ("disk",) and cfg.max_local_cpu_size == TRANSFER_ARENA_GB
    assert "transfer arena" in caplog.text
    with pytest.raises(ConfigError, match="max_local_cpu_size"):  # a CPU tier needs memory
        load_config(_write(tmp_path, "local_cpu: true\nmax_local_cpu_size: 0\n"), env={})


def test_local_cpu_false_never_holds_the_cpu_tier_s_default_arena(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    disk = f"local_cpu: False\nlocal_disk: {tmp_path}\nmax_local_disk_size: 1\n"
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(_write(tmp_path, disk), env={})  # an LMCache disk-only file
    assert cfg.max_local_cpu_size == TRANSFER_ARENA_GB < Config().max_local_cpu_size
    assert "unset with local_cpu: false" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        big = load_config(_write(tmp_path, disk + "max_local_cpu_size: 5\n"), env={})
    assert big.max_local_cpu_size == 5  # what the file asks for, and the note says what for
    assert "holds all 5 GB as its transfer arena" in caplog.text


def test_metrics_port() -> None:
    assert Config().metrics_port is None
    assert load_config(env={"KVTIER_METRICS_PORT": "9400"}).metrics_port == 9400
    assert load_config(env={"KVTIER_METRICS_PORT": "null"}).metrics_port is None


# ---- bad input found in review: each a ConfigError naming the key --------------------------

_FLOAT_KEYS = [f.name for f in fields(Config) if f.type in ("float", "float | None")]


@pytest.mark.parametrize("key", _FLOAT_KEYS)
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "'nan'", "'inf'", "1.0e400"])
def test_nan_and_inf_are_config_errors_in_every_numeric_key(tmp_path: Path, key: str,
                                                             value: str) -> None:
    path = _write(tmp_path, f"{key}: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert f": {key}: " in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("key", _FLOAT_KEYS)
def test_nan_from_env_or_code_is_a_config_error(key: str) -> None:
    with pytest.raises(ConfigError, match=f"KVTIER_{key.upper()}"):
        load_config(env={f"KVTIER_{key.upper()}": ".nan"})
    with pytest.raises(ConfigError, match=key):
        Config(**{key: math.nan})  # type: ignore[arg-type]


def test_huge_ints_in_numeric_keys_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_local_cpu_size"):
        load_config(_write(tmp_path, f"max_local_cpu_size: {10 ** 400}\n"), env={})


def test_more_cpu_memory_than_the_machine_has(tmp_path: Path) -> None:
    """A file sized for a bigger host is a valid file; the launch, and a storage manager
    about to allocate its arena, refuse it naming the key."""
    import torch

    from kvtier.config.host import check_host
    from kvtier.memory import KVLayout
    from kvtier.storage import StorageManager

    total_gb = physical_memory_bytes() / 1e9
    path = _write(tmp_path, f"max_local_cpu_size: {total_gb * 2:.1f}\n")
    cfg = load_config(path, env={})
    with pytest.raises(ConfigError, match="max_local_cpu_size"):
        check_host(cfg)
    with pytest.raises(ConfigError, match="max_local_cpu_size"):
        StorageManager(cfg, KVLayout.mha(1, 1, 16, torch.float16))


def test_password_in_query_string_is_redacted_everywhere(tmp_path: Path) -> None:
    assert redact_url("redis://h:1/0?password=hunter2&db=1") == \
        "redis://h:1/0?password=***&db=1"
    assert "hunter2" not in redact_url("rediss://u:hunter2@h:1?ssl_ca_certs=/c&token=hunter2")
    path = _write(tmp_path, "remote_url: 'redis://h:1/0?password=hunter2'\n")
    with pytest.raises(ConfigError, match="remote_url") as err:
        load_config(path, env={})
    assert "hunter2" not in str(err.value)
    with pytest.raises(ConfigError, match="KVTIER_REMOTE_URL") as err:
        load_config(env={"KVTIER_REMOTE_URL": "lm://u:hunter2@h:1?password=hunter2"})
    assert "hunter2" not in str(err.value)


def test_config_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("hash_salt: 'caf\xe9'\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="UTF-8") as err:
        load_config(path, env={})
    assert str(path) in str(err.value)


@pytest.mark.parametrize(("text", "key"), [
    ("chunk_size: 64\nchunk_size: 128\n", "chunk_size"),
    ("use_layerwise: true\nuse_layerwise: false\n", "use_layerwise"),
    ("extra_config:\n  password: a\n  password: b\n", "password"),
])
def test_duplicate_yaml_keys(tmp_path: Path, text: str, key: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match="duplicate key") as err:
        load_config(path, env={})
    assert f"{path}: {key}: " in str(err.value)


def test_local_disk_file_url_without_path_is_not_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="local_disk"):
        load_config(_write(tmp_path, "local_disk: 'file://'\nmax_local_disk_size: 1\n"),
                    env={})
    assert list(tmp_path.iterdir()) == [tmp_path / "kvtier.yaml"]  # nothing created


def test_unknown_lmcache_like_key_suggests_the_lmcache_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'enable_async_loading'"):
        load_config(_write(tmp_path, "enable_async_load: false\n"), env={})


def test_a_key_lmcaches_own_examples_set_loads_ignored(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    # LMCache's RESP example sets async_loading, which no LMCache release reads.
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(_write(tmp_path, "chunk_size: 256\nasync_loading: false\n"), env={})
    assert cfg.chunk_size == 256
    assert "async_loading: ignored: set by LMCache's RESP example" in caplog.text


def test_log_level_sets_kvtier_loggers_and_rejects_unknown_levels() -> None:
    import torch

    from kvtier.connectors import SGLangMHAConnector
    from kvtier.engine import CacheEngine
    from tests.helpers import SMALL_MHA

    with pytest.raises(ConfigError, match="log_level"):
        Config(log_level="loud")
    pool = [torch.zeros(8, 2, 8, dtype=SMALL_MHA.dtype) for _ in range(2)]
    logger = logging.getLogger("kvtier")
    before = logger.level
    try:
        with CacheEngine(Config(chunk_size=16, max_local_cpu_size=0.001, log_level="DEBUG"),
                         model_name="m", layout=SMALL_MHA,
                         connector=SGLangMHAConnector(pool, pool)):
            assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize("url, secret", [
    ("redis://:SECRETpw@host:6379 ", "SECRETpw"),  # a trailing space
    ("redis://:SECRETpw@bücher.example:6379", "SECRETpw"),  # an IDN host
    ("redis://:SECRETpw@h:1#frag", "SECRETpw"),
    ("redis://us er:SECRETpw@h:1", "SECRETpw"),  # not a plain user: all of it hidden
    ("redis:/:SECRETpw@h", "SECRETpw"),  # no "://": nothing of it shown
])
def test_redact_url_works_by_structure(url: str, secret: str) -> None:
    redacted = redact_url(url)
    assert secret not in redacted and "***" in redacted


@pytest.mark.parametrize("url, pieces", [
    ("redis://:ab/cd+ef==@h", ["ab", "cd+ef=="]),  # urllib quotes 'ab' as a port
    ("redis://user:s3cr?et@h", ["s3cr", "et"]),  # the parse takes '?et@h' for a query
    ("redis://:SECRETpw@host:6379 ", ["SECRETpw"]),
    ("redis://:SECRETpw@bücher.example:notaport", ["SECRETpw"]),
])
def test_no_piece_of_a_password_reaches_a_config_error(url: str, pieces: list[str],
                                                       tmp_path: Path) -> None:
    path = _write(tmp_path, f"remote_url: {url!r}\n")
    try:
        cfg = load_config(path, env={})
    except ConfigError as exc:
        text = str(exc)
    else:  # it parsed (whitespace stripped): its shown forms must hold no secret either
        assert cfg.remote_url == url.strip()
        text = repr(cfg) + str(cfg.redacted())
    for piece in pieces:
        assert f"'{piece}'" not in text and f":{piece}@" not in text and piece + "@" not in text


@pytest.mark.parametrize("text", ["hash_salt: yes\n", "hash_salt: on\n", "hash_salt: 0123\n",
                                  "hash_salt: 1.0000000000000000001\n"])
def test_hash_salt_is_a_string_only(tmp_path: Path, text: str) -> None:
    # Different salts that str() of the YAML value would make one ('True', '83', '1.0').
    with pytest.raises(ConfigError, match=r"hash_salt: must be a string: quote it") as err:
        load_config(_write(tmp_path, text), env={})
    assert "0123" not in str(err.value) and "yes" not in str(err.value)  # a secret: not shown
    assert load_config(_write(tmp_path, "hash_salt: 'yes'\n"), env={}).hash_salt == "yes"
