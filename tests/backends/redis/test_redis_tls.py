"""TLS for `redis-cluster://` and `redis-sentinel://`, sentinel credentials and the clear-text
password warning (issue 18): URL parsing, then real TLS servers (fixtures in tests/conftest.py).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import pytest

from harness.redis import RedisTLSCluster, RedisTLSSentinel
from kvtier.backends.redis import RedisBackend
from kvtier.backends.redis.router import Router
from kvtier.backends.redis.url import parse_remote_url
from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.memory import lease
from tests.helpers import make_keys, put_random, same_bytes

WARN_LOGGER = "kvtier.backends.redis.url"
CA = "/etc/kv/ca.pem"


def _host() -> str:
    """A fresh non-loopback host name: the warning is given once per URL per process."""
    return f"db-{uuid.uuid4().hex[:10]}.example"


# ---- parsing: TLS on cluster and sentinel ------------------------------------------------

def test_cluster_takes_ssl_and_every_ssl_parameter() -> None:
    target = parse_remote_url(
        f"redis-cluster://u:hunter2@10.0.0.1:7000,10.0.0.2?ssl=true&ssl_ca_certs={CA}"
        "&ssl_certfile=/etc/kv/c%2Bert.pem&ssl_keyfile=/etc/kv/key.pem&ssl_cert_reqs=optional"
        "&ssl_check_hostname=false&ssl_ca_path=/etc/kv/cas")
    assert target.kind == "cluster"
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379))
    assert dict(target.kwargs) == {
        "ssl": True, "ssl_ca_certs": CA, "ssl_certfile": "/etc/kv/c+ert.pem",
        "ssl_keyfile": "/etc/kv/key.pem", "ssl_cert_reqs": "optional",
        "ssl_check_hostname": False, "ssl_ca_path": "/etc/kv/cas",
        "username": "u", "password": "hunter2"}
    assert dict(target.sentinel_kwargs) == {}


@pytest.mark.parametrize("flag, tls", [("true", True), ("1", True), ("YES", True),
                                       ("false", False), ("0", False), ("no", False)])
def test_ssl_flag_spellings(flag: str, tls: bool) -> None:
    target = parse_remote_url(f"redis-cluster://h1:1,h2:2?ssl={flag}")
    assert target.kwargs.get("ssl", False) is tls


def test_sentinel_tls_reaches_sentinels_and_data_nodes_with_separate_credentials() -> None:
    target = parse_remote_url(
        f"redis-sentinel://data-user:data%2Bpw@s1:5000,s2/svc?ssl=true&ssl_ca_certs={CA}"
        "&sentinel_username=sent-user&sentinel_password=s%26nt+pw")
    assert (target.kind, target.service) == ("sentinel", "svc")
    assert target.nodes == (("s1", 5000), ("s2", 26379))
    tls = {"ssl": True, "ssl_ca_certs": CA, "ssl_check_hostname": True}
    assert dict(target.kwargs) == {**tls, "username": "data-user", "password": "data+pw"}
    # `+` stays `+`, `%26` is `&`: a password is taken byte for byte.
    assert dict(target.sentinel_kwargs) == {**tls, "username": "sent-user",
                                            "password": "s&nt+pw"}


def test_sentinel_without_sentinel_credentials_queries_without_any() -> None:
    target = parse_remote_url("redis-sentinel://:data-pw@127.0.0.1:26379/svc")
    assert dict(target.sentinel_kwargs) == {}
    assert target.kwargs["password"] == "data-pw"


def test_rediss_keeps_its_ssl_parameters_decoded_like_the_others() -> None:
    target = parse_remote_url("rediss://h:1?ssl_ca_certs=/a+b%20c.pem&ssl_check_hostname=no"
                              "&client_name=kv+1")
    assert target.kwargs["ssl_ca_certs"] == "/a+b c.pem"
    assert target.kwargs["ssl_check_hostname"] is False
    assert target.kwargs["client_name"] == "kv+1"


@pytest.mark.parametrize("url, problem", [
    (f"redis-cluster://:hunter2@h:1?ssl_ca_certs={CA}", "without ssl=true"),
    (f"redis-sentinel://:hunter2@h/svc?ssl=false&ssl_ca_certs={CA}", "without ssl=true"),
    ("redis-cluster://:hunter2@h:1?ssl=maybe", "ssl must be true or false"),
    ("redis-cluster://:hunter2@h:1?ssl=true&ssl_check_hostname=perhaps", "ssl_check_hostname"),
    ("redis-cluster://:hunter2@h:1?ssl=true&ssl_cert_reqs=always", "ssl_cert_reqs"),
    ("rediss://:hunter2@h:1?ssl_cert_reqs=REQUIRED", "ssl_cert_reqs"),
    ("redis-cluster://:hunter2@h:1?ssl=true&ssl_certfile=", "needs a path"),
    ("redis-cluster://:hunter2@h:1?ssl=true&ssl_password=hunter2", "query parameter"),
    ("redis-cluster://:hunter2@h:1?sentinel_password=hunter2", "query parameter"),
    ("redis-sentinel://h/svc?sentinel_username=u", "needs sentinel_password"),
    ("redis://:hunter2@h:1?ssl=true", "query parameter"),
    ("rediss://:hunter2@h:1?ssl=true", "query parameter"),
])
def test_bad_tls_or_sentinel_parameters_are_config_errors_without_secrets(
    url: str, problem: str,
) -> None:
    with pytest.raises(ConfigError, match=problem) as info:
        parse_remote_url(url)
    assert "remote_url" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_secrets_never_appear_in_repr_or_url() -> None:
    target = parse_remote_url(
        "redis-sentinel://u:data-secret@127.0.0.1/svc?ssl=true"
        "&sentinel_username=su&sentinel_password=sentinel-secret")
    for text in (repr(target), str(target), target.url):
        assert "data-secret" not in text and "sentinel-secret" not in text
    assert "sentinel_password=***" in target.url


def test_config_check_accepts_tls_cluster_and_sentinel_urls() -> None:
    Config(remote_url=f"redis-cluster://127.0.0.1:1,127.0.0.1:2?ssl=true&ssl_ca_certs={CA}")
    Config(remote_url="redis-sentinel://127.0.0.1:1/svc?ssl=true&sentinel_password=x")
    with pytest.raises(ConfigError, match="without ssl=true"):
        Config(remote_url=f"redis-cluster://127.0.0.1:1?ssl_ca_certs={CA}")


# ---- the clear-text password warning -----------------------------------------------------

def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == WARN_LOGGER and r.levelno == logging.WARNING]


@pytest.mark.parametrize("template, fix", [
    ("redis://:hunter2@{host}:6379", "rediss://"),
    ("redis://kvuser:hunter2@{host}:6379/2", "rediss://"),
    ("redis-cluster://:hunter2@127.0.0.1:7000,{host}:7001", "?ssl=true"),
    ("redis-cluster://:hunter2@{host}:7000?ssl=false", "?ssl=true"),
    ("redis-sentinel://:hunter2@{host}/svc", "?ssl=true"),
    ("redis-sentinel://{host}/svc?sentinel_password=hunter2", "?ssl=true"),
    ("redis://:hunter2@10.1.2.3:6379", "rediss://"),
])
def test_a_password_without_tls_to_another_host_warns_once(
    template: str, fix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    host = _host()
    url = template.format(host=host)
    if "10.1.2.3" in url:  # an IP address: make the URL unique by its user instead
        url = url.replace(":hunter2@", f"{uuid.uuid4().hex[:8]}:hunter2@")
    with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
        parse_remote_url(url)
        parse_remote_url(url)
        Config(remote_url=url)  # the config check parses it too: still one warning
    (message,) = _warnings(caplog)
    assert "crosses the network in clear" in message and fix in message
    assert "hunter2" not in message and "hunter2" not in caplog.text
    assert "10.1.2.3" in message or host in message


@pytest.mark.parametrize("template", [
    "redis://:hunter2@127.0.0.1:6379",
    "redis://:hunter2@127.8.9.10:6379",
    "redis://:hunter2@localhost:6379",
    "redis://:hunter2@[::1]:6379",
    "redis-cluster://:hunter2@127.0.0.1:7000,localhost:7001",
    "redis-sentinel://127.0.0.1/svc?sentinel_password=hunter2",
    "unix://:hunter2@/run/redis-{tag}.sock",
    "rediss://:hunter2@{host}:6379",
    "redis-cluster://:hunter2@{host}:7000?ssl=true",
    "redis-sentinel://:hunter2@{host}/svc?ssl=true&sentinel_password=hunter2",
    "redis://{host}:6379",
    "redis://kvuser@{host}:6379",
    "redis-cluster://{host}:7000",
])
def test_no_warning_for_loopback_unix_tls_or_no_password(
    template: str, caplog: pytest.LogCaptureFixture,
) -> None:
    url = template.format(host=_host(), tag=uuid.uuid4().hex[:8])
    with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
        parse_remote_url(url)
    assert _warnings(caplog) == []


# ---- real TLS servers --------------------------------------------------------------------

def _round_trip(backend: RedisBackend, num_tokens: int, seed: int) -> None:
    ctx = backend.ctx
    keys = make_keys(num_tokens, seed=seed)
    expected = put_random(backend.batch_put, ctx.allocator, ctx.layout, keys, seed)
    assert backend.batch_contains(keys) == len(keys)
    with lease(backend.batch_get(keys)) as got:
        assert len(got) == len(keys)
        for obj, want in zip(got, expected):
            assert same_bytes(obj.tensor, want)


def test_tls_cluster_round_trip_over_every_master(
    redis_tls_cluster: RedisTLSCluster, make_backend: Callable[[str], RedisBackend],
) -> None:
    backend = make_backend(redis_tls_cluster.url)
    assert backend.stats()["down"] == 0
    _round_trip(backend, 16 * 24, seed=181)
    assert all(node.client().dbsize() > 0 for node in redis_tls_cluster.nodes)
    assert backend.stats()["down"] == 0


def test_plain_url_to_a_tls_cluster_does_not_come_up(
    redis_tls_cluster: RedisTLSCluster, make_backend: Callable[[str], RedisBackend],
) -> None:
    plain = redis_tls_cluster.url.partition("?")[0]
    backend = make_backend(plain)
    assert backend.stats()["down"] == 1
    assert backend.batch_contains(make_keys(32, seed=182)) == 0


def test_tls_sentinel_with_sentinel_password_finds_the_master(
    redis_tls_sentinel: RedisTLSSentinel, make_backend: Callable[[str], RedisBackend],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG):
        backend = make_backend(redis_tls_sentinel.url)
        assert backend.stats()["down"] == 0
        _round_trip(backend, 16 * 8, seed=183)
    assert redis_tls_sentinel.master.client().dbsize() >= 8
    for secret in (redis_tls_sentinel.master.password, redis_tls_sentinel.sentinel.password):
        assert secret and secret not in caplog.text


@pytest.mark.parametrize("change", ["drop", "wrong", "data-password-only"])
def test_tls_sentinel_refuses_queries_without_its_own_password(
    change: str, redis_tls_sentinel: RedisTLSSentinel,
    make_backend: Callable[[str], RedisBackend], caplog: pytest.LogCaptureFixture,
) -> None:
    good = f"&sentinel_password={redis_tls_sentinel.sentinel.password}"
    url = redis_tls_sentinel.url
    assert good in url
    if change == "drop":
        url = url.replace(good, "")
    elif change == "wrong":
        url = url.replace(good, "&sentinel_password=wrong-sentinel-pw")
    else:  # the data nodes' password is not offered to the sentinels
        url = url.replace(good, "").replace(
            f":{redis_tls_sentinel.master.password}@", f":{redis_tls_sentinel.sentinel.password}@")
    with caplog.at_level(logging.DEBUG):
        backend = make_backend(url)
        assert backend.stats()["down"] == 1
        assert backend.batch_contains(make_keys(32, seed=184)) == 0
    for secret in ("wrong-sentinel-pw", redis_tls_sentinel.master.password,
                   redis_tls_sentinel.sentinel.password):
        assert secret and secret not in caplog.text


@pytest.mark.parametrize("template", [
    "rediss://:hunter2@{host}:6379?ssl_cert_reqs=none",
    "redis-cluster://:hunter2@{host}:7000?ssl=true&ssl_cert_reqs=none",
])
def test_a_password_over_tls_that_verifies_nothing_warns_once(
    template: str, caplog: pytest.LogCaptureFixture,
) -> None:
    url = template.format(host=_host())
    with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
        parse_remote_url(url)
        Config(remote_url=url)
    (message,) = _warnings(caplog)
    assert "ssl_cert_reqs=none" in message and "whoever answers" in message
    assert "hunter2" not in caplog.text


# ---- host name checks (issue 36, item 7) -------------------------------------------------
# redis-py checks a TLS server's host name by default only from 6.0, and a cluster hands the
# setting to its nodes only from 6.1: kvtier sets it on every TLS connection it builds.

@pytest.mark.parametrize("url, check", [
    ("rediss://h:1", True),
    (f"rediss://h:1?ssl_ca_certs={CA}&ssl_cert_reqs=optional", True),
    ("rediss://h:1?ssl_check_hostname=false", False),  # the URL's own choice stands
    ("rediss://h:1?ssl_cert_reqs=none", False),  # no certificate: no name to match
    ("redis-cluster://h1:1,h2:2?ssl=true", True),
    ("redis-sentinel://s1:1/svc?ssl=true&sentinel_password=x", True),
    ("redis-cluster://h1:1?ssl=true&ssl_cert_reqs=none", False),
])
def test_tls_targets_check_host_names_explicitly(url: str, check: bool) -> None:
    target = parse_remote_url(url)
    assert target.kwargs["ssl_check_hostname"] is check
    if target.kind == "sentinel":
        assert target.sentinel_kwargs["ssl_check_hostname"] is check


def test_plain_targets_carry_no_tls_settings() -> None:
    for url in ("redis://h:1", "redis-cluster://h1:1?ssl=false", "unix:///run/r.sock"):
        assert "ssl_check_hostname" not in parse_remote_url(url).kwargs


def test_built_tls_connections_check_host_names() -> None:
    """The connection pools kvtier builds (no network: standalone and sentinel) ask for it."""
    for url in ("rediss://:pw@127.0.0.1:1", "redis-sentinel://127.0.0.1:1/svc?ssl=true"):
        router = Router(parse_remote_url(url), timeout=0.1)
        try:
            pool = router.node_for("k").connection_pool
            assert pool.connection_class.__name__.endswith("SSLConnection")
            assert pool.connection_kwargs["ssl_check_hostname"] is True
        finally:
            router.close()


def test_a_tls_cluster_checks_the_host_name_of_every_node(
    redis_tls_cluster: RedisTLSCluster,
) -> None:
    router = Router(parse_remote_url(redis_tls_cluster.url), timeout=2.0)
    try:
        primaries = router.primaries()
        assert len(primaries) == 3
        for client in primaries:
            assert client.connection_pool.connection_kwargs["ssl_check_hostname"] is True
        router.ping()  # the test certificate names 127.0.0.1: the check passes
    finally:
        router.close()
