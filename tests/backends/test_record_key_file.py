"""The record key file is trusted only when nobody else can change it and its key cannot be
guessed (issue 51, item 7: another user's file, a file in a world-writable directory and a
low-entropy key were accepted; with the key id in every record a weak key fell offline in 526
guesses)."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.backends.sealing import load_record_keys
from kvtier.errors import ConfigError

GOOD = base64.b64encode(bytes(range(7, 39)))  # 32 distinct bytes, as base64


def _key_file(directory: Path, secret: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "record.key"
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return path


def test_a_good_key_in_a_private_directory_loads(tmp_path: Path) -> None:
    assert load_record_keys(str(_key_file(tmp_path / "keys", GOOD))) is not None


@pytest.mark.parametrize("secret", [
    b"a" * 40, b"passwordpasswordpasswordpassword", b"0101010101010101010101010101010101",
    # issue 67: a repeated phrase counted as many bytes as it was long (frequencies only)
    b"correcthorse" * 4, b"correcthorse" * 8, b"correcthorse" * 4 + b"!",
    b"0123456789abcdef" * 2, b"Tr0ub4dor&3" * 3, b"-".join([b"correct", b"horse"] * 4),
])
def test_a_guessable_key_is_refused_naming_the_file_never_the_key(
        tmp_path: Path, secret: bytes) -> None:
    path = _key_file(tmp_path / "keys", secret)
    with pytest.raises(ConfigError, match="looks guessable") as info:
        load_record_keys(str(path))
    assert str(path) in str(info.value) and secret.decode()[:12] not in str(info.value)


@pytest.mark.parametrize("encode", [base64.b64encode, lambda b: b.hex().encode()])
def test_random_keys_of_32_bytes_always_pass(tmp_path: Path, encode: Callable) -> None:
    """`head -c 32 /dev/urandom | base64` (44 characters) or as 64 hex digits: 2000 of each,
    so a check that refused even one random key in a few hundred would fail here."""
    path = _key_file(tmp_path / "keys", b"")
    for _ in range(2000):
        path.write_bytes(encode(os.urandom(32)) + b"\n")
        assert load_record_keys(str(path)) is not None


def test_a_nul_byte_in_the_path_is_a_config_error(tmp_path: Path) -> None:
    """Issue 67: open() raised ValueError ("embedded null byte"), an internal error at launch;
    a NUL in the key itself is a byte of the key like any other."""
    path = str(_key_file(tmp_path / "keys", GOOD))
    with pytest.raises(ConfigError, match=r"^record_key_file: .* holds a NUL byte"):
        load_record_keys(path + "\0")
    _key_file(tmp_path / "keys", GOOD[:10] + b"\0" + GOOD[10:])
    assert load_record_keys(path) is not None


def test_a_key_file_in_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    path = _key_file(shared, GOOD)
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="which other users may write"):
        load_record_keys(str(path))
    shared.chmod(0o1777)  # sticky, as /tmp: others cannot replace a file they do not own
    assert load_record_keys(str(path)) is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")
def test_another_users_key_file_is_refused(tmp_path: Path) -> None:
    path = _key_file(tmp_path / "keys", GOOD)
    os.chown(path, 12345, 12345)
    with pytest.raises(ConfigError, match="belongs to uid 12345"):
        load_record_keys(str(path))


def test_key_names_are_keyed_by_the_record_key_and_stable_across_a_rotation(
        tmp_path: Path) -> None:
    """Issue 51, item 5: with a record key, a reader of the tier who lacks it cannot test a
    guessed prompt against the key names; adding a new current key keeps every name."""
    import torch

    from kvtier.config import Config
    from kvtier.connectors import SGLangMHAConnector
    from kvtier.engine import CacheEngine
    from tests.helpers import SMALL_MHA

    other = base64.b64encode(bytes(range(101, 133)))
    one = _key_file(tmp_path / "one", GOOD)
    rotated = _key_file(tmp_path / "rotated", other + b"\n" + GOOD)  # new current key first
    stranger = _key_file(tmp_path / "stranger", other)
    ids = torch.arange(100, 164)

    def names(key_file: Path | None) -> list[str]:
        pool = [torch.zeros(8, SMALL_MHA.num_kv_heads, SMALL_MHA.head_dim,
                            dtype=SMALL_MHA.dtype) for _ in range(2 * SMALL_MHA.num_layers)]
        config = Config(chunk_size=16, max_local_cpu_size=0.01, hash_salt="s",
                        record_key_file=str(key_file) if key_file else None)
        with CacheEngine(config, model_name="m", layout=SMALL_MHA,
                         connector=SGLangMHAConnector(pool[::2], pool[1::2])) as engine:
            return [k.key for k in engine.chunk_keys(ids)]

    plain, keyed = names(None), names(one)
    assert set(plain).isdisjoint(keyed)  # the names without the key are not the names
    assert names(rotated) == keyed  # a rotation keeps the names
    assert set(names(stranger)).isdisjoint(keyed)


def test_a_shared_tier_with_guessable_names_warns_once_at_start(
        tmp_path: Path, redis_server, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    from kvtier.config import Config
    from kvtier.storage import StorageManager
    from tests.helpers import SMALL_MHA

    for salt, key_file, warned in (("", None, True), ("x" * 16, None, False),
                                   ("", str(_key_file(tmp_path / "k", GOOD)), False)):
        caplog.clear()
        config = Config(chunk_size=16, max_local_cpu_size=0.01, remote_url=redis_server.url,
                        hash_salt=salt, record_key_file=key_file)
        with caplog.at_level("WARNING"):
            StorageManager(config, SMALL_MHA).close()
        assert ("whoever can list the Redis can test" in caplog.text) == warned, (salt, key_file)
        plain = [r.getMessage() for r in caplog.records if "record_key_file" in r.getMessage()]
        assert len(plain) == (key_file is None)  # one line: names and forging together


@pytest.mark.parametrize("tiers", [("disk",), ("disk", "redis")])
def test_plain_records_warn_once_at_start_that_they_can_be_forged(
        tiers: tuple[str, ...], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        request: pytest.FixtureRequest) -> None:
    """Issue 67: the warning spoke of key names only, and a disk tier gave none."""
    from kvtier.config import Config
    from kvtier.storage import StorageManager
    from tests.helpers import SMALL_MHA

    redis = {"remote_url": request.getfixturevalue("redis_server").url} if "redis" in tiers \
        else {}
    for key_file in (None, str(_key_file(tmp_path / "k", GOOD))):
        caplog.clear()
        config = Config(chunk_size=16, max_local_cpu_size=0.01, hash_salt="x" * 16,
                        local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01,
                        record_key_file=key_file, **redis)
        with caplog.at_level("WARNING", logger="kvtier"):
            StorageManager(config, SMALL_MHA).close()
        plain = [r.getMessage() for r in caplog.records if "plain records" in r.getMessage()]
        if key_file is not None:
            assert plain == []
            continue
        [line] = plain
        assert "\n" not in line and f"the {' and '.join(tiers)} tier" in line
        assert "anyone who can write there can forge records that this server will serve " \
               "as KV" in line and "read the prompts back" in line
        assert "set record_key_file" in line and "docs/security.md" in line
