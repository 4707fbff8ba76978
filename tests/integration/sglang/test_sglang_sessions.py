"""Sessions and run-time tiers on a real SGLang server (tiny Llama, CPU).

A: a small CPU tier (pins capped at half of it). A session's prompt stays pinned while other
   traffic evicts everything else, so its next turn is a hit; closing the session unpins it.
   A request's lifecycle hints (`custom_params`): a prompt retained for 600 s survives the
   same traffic; an ephemeral span is never stored.
B: declares a Redis. Detached over HTTP (`kvtier tiers`) while a stream runs, it serves no
   hits; attached again, it serves what another server stored. Attaches HTTP may not make are
   refused, and an attach to a Redis that stopped answering fails off the scheduler thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.delay_proxy import DelayProxy
from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from kvtier.cli import main as kvtier_main
from kvtier.cli import tiers as cli_tiers
from kvtier.storage.sessions import session_tag
from tests.integration.sglang.conftest import CHUNK, cold, prompt, write_config

pytestmark = pytest.mark.sglang

TURN = 10 * CHUNK + 5
ADMIN = "kvtier-test-admin"
# 2 layers x 2 KV heads x 16 dims x K,V x float32 = 512 bytes a token: 8 KiB a chunk, so an
# arena of 60 chunks; sessions may pin 48 of them (fraction 0.8), one session a quarter: 12.
ARENA_GB = 60 * 8192 / 1e9
PINNED_FRACTION = 0.8


def _session_generate(server: SGLangServer, sid: str, ids: list[int],
                      rid: str | None = None) -> dict:
    params = {"id": sid, **({"rid": rid} if rid else {})}
    return server.post("/generate", {
        "input_ids": ids, "session_params": params,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}})


def _hinted_generate(server: SGLangServer, ids: list[int], hints: dict) -> dict:
    return server.post("/generate", {
        "input_ids": ids, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True,
            "custom_params": hints}})


def test_session_prefix_survives_eviction_until_the_session_closes(
        start_server: Callable[..., SGLangServer], tiny_llama: Path, tmp_path: Path) -> None:
    server = start_server(tiny_llama, write_config(tmp_path / "a.yaml",
                                                   max_local_cpu_size=ARENA_GB,
                                                   max_session_pinned_fraction=PINNED_FRACTION))
    sid = server.post("/open_session", {"capacity_of_str_len": 100_000})
    assert isinstance(sid, str) and sid
    turn = prompt(50, TURN)
    first = _session_generate(server, sid, turn)
    other = prompt(51, TURN)
    server.generate(other)
    retained = prompt(53, TURN)
    _hinted_generate(server, retained, {"kvtier_retain_s": 600})
    # The tokens from 7 past the third chunk on are ephemeral: at most those 3 chunks and a
    # tail of 7 tokens (`save_tails`) are stored, not the other 7.
    ephemeral = prompt(54, TURN)
    _hinted_generate(server, ephemeral, {"kvtier_ephemeral_from": 3 * CHUNK + 7})
    server.flush_cache()
    cached = server.generate(ephemeral)["meta_info"]["cached_tokens"]
    assert 3 * CHUNK <= cached <= 3 * CHUNK + 7
    for seed in range(60, 75):  # 15 prompts x 10 chunks: far more than the arena holds
        server.generate(prompt(seed, TURN))
    server.flush_cache()

    # Not pinned: evicted. Pinned, by its session or by a hint: the whole prompt loads.
    assert server.generate(other)["meta_info"]["cached_tokens"] == 0
    assert server.generate(retained)["meta_info"]["cached_tokens"] >= TURN // CHUNK * CHUNK
    follow_up = prompt(52, 20)
    second = _session_generate(server, sid, follow_up, rid=first["meta_info"]["id"])
    assert second["meta_info"]["cached_tokens"] >= TURN // CHUNK * CHUNK
    expected = cold(server, [*turn, *first["output_ids"], *follow_up])
    assert second["output_ids"] == expected[:4]

    server.post("/close_session", {"session_id": sid})
    # The scheduler closes the session after the HTTP reply.
    # Logged by its tag: a session id is a bearer handle and never appears in a log.
    server.wait_for_log(f"kvtier: session {session_tag(sid)} closed; its prefix is no longer "
                        f"pinned")
    # (SGLang itself logs the id when the session opens; kvtier's lines never do.)
    assert not [line for line in server.log().splitlines() if "kvtier" in line and sid in line]


@pytest.fixture(scope="module")
def redis(redis_factory: Callable[..., RedisProcess]) -> RedisProcess:
    return redis_factory()


def test_redis_detached_and_attached_over_http_while_serving(
        start_server: Callable[..., SGLangServer], tiny_llama: Path, redis: RedisProcess,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    writer = start_server(tiny_llama, write_config(tmp_path / "w.yaml", remote_url=redis.url))
    # Launched now, it starts while the writer serves.
    clients = start_server(tiny_llama, write_config(tmp_path / "k.yaml", remote_url=redis.url),
                           "--api-key", "client-key", ready=False)
    shared = [prompt(80, TURN), prompt(81, TURN)]
    expected = [cold(writer, ids) for ids in shared]
    for ids in shared:
        writer.generate(ids)
    writer.flush_cache()
    # No --admin-api-key on this server: tiers can be listed, never changed.
    attach = {"op": "attach", "tier": "redis", "config": {}}
    assert cli_tiers.request(writer.url, attach)[0] == 403
    assert cli_tiers.request(writer.url, None)[0] == 200
    writer.stop()

    # Only --api-key (inference clients' key): that key changes no tier either.
    clients.wait_ready()
    assert cli_tiers.request(clients.url, attach, "client-key")[0] == 403
    assert cli_tiers.request(clients.url, attach)[0] in (401, 403)
    assert clients.generate(shared[0])["output_ids"] == expected[0]  # it serves, with its key
    status, listed = cli_tiers.request(clients.url, None, "client-key")
    assert status == 200 and list(listed["ranks"][0]["tiers"]) == ["cpu", "redis"]
    clients.stop()

    # B declares the Redis (through a proxy that can turn into a tarpit).
    with DelayProxy(redis.port, 0.0) as proxy:
        cfg = write_config(tmp_path / "b.yaml", remote_url=proxy.url, remote_timeout_secs=1.0)
        server = start_server(tiny_llama, cfg, "--admin-api-key", ADMIN)
        _detach_and_attach(server, shared, expected, capsys)
        _refused_attaches(server)
        _attach_to_a_tarpit(server, proxy)


def _tiers(server: SGLangServer) -> list[str]:
    status, listed = cli_tiers.request(server.url, None, ADMIN)
    assert status == 200
    return list(listed["ranks"][0]["tiers"])


def _detach_and_attach(server: SGLangServer, shared: list[list[int]],
                       expected: list[list[int]], capsys: pytest.CaptureFixture[str]) -> None:
    assert _tiers(server) == ["cpu", "redis"]
    attach = {"op": "attach", "tier": "redis", "config": {}}
    assert cli_tiers.request(server.url, attach)[0] == 401  # no key
    assert cli_tiers.request(server.url, attach, "not-the-admin-key")[0] == 401

    streaming = threading.Thread(target=server.generate, args=(prompt(90, 40), 300))
    streaming.start()  # detach and attach while a request runs
    assert kvtier_main(["tiers", "--server", server.url, "--admin-key", ADMIN, "detach",
                        "redis"]) == 0
    got = server.generate(shared[0])  # in Redis, but Redis is no longer attached
    assert got["meta_info"]["cached_tokens"] == 0
    assert got["output_ids"] == expected[0]

    assert kvtier_main(["tiers", "--server", server.url, "--admin-key", ADMIN, "attach",
                        "redis", "--set", "remote_timeout_secs=2"]) == 0
    out = capsys.readouterr().out
    assert "state: attached" in out and "- redis" in out
    streaming.join(120)
    got = server.generate(shared[1])
    assert got["meta_info"]["cached_tokens"] == TURN - 1  # all but the last prompt token
    assert got["output_ids"] == expected[1]


def _refused_attaches(server: SGLangServer) -> None:
    """What HTTP may not attach: an address of its own, a key the tier does not take, a tier
    the config does not declare, a long connect timeout. Nothing changes."""
    for config, named in (({"remote_url": "redis://evil:6379"}, "remote_url"),
                          ({"remote_urll": "x"}, "remote_urll"),
                          ({"chunk_size": 64}, "chunk_size"),
                          ({"remote_timeout_secs": 3600}, "remote_timeout_secs")):
        status, answer = cli_tiers.request(
            server.url, {"op": "attach", "tier": "redis", "config": config}, ADMIN)
        assert status == 400 and named in answer["ranks"][0]["error"], answer
        assert "evil" not in str(answer)
    status, answer = cli_tiers.request(server.url, {"op": "attach", "tier": "disk"}, ADMIN)
    assert status == 400 and "not declared" in answer["ranks"][0]["error"]
    assert _tiers(server) == ["cpu", "redis"]


def _attach_to_a_tarpit(server: SGLangServer, proxy: DelayProxy) -> None:
    """The declared Redis stops answering: an attach fails on its own thread while a stream
    runs to the end (the scheduler never waited on the connect)."""
    assert kvtier_main(["tiers", "--server", server.url, "--admin-key", ADMIN, "detach",
                        "redis"]) == 0
    proxy.delay_s = 3600.0  # accepts, never answers in time
    done: list[dict] = []
    streaming = threading.Thread(target=lambda: done.append(
        server.generate(prompt(91, 40), 200)))
    streaming.start()
    assert kvtier_main(["tiers", "--server", server.url, "--admin-key", ADMIN, "attach",
                        "redis"]) == 1
    streaming.join(120)
    assert done and len(done[0]["output_ids"]) == 200
    assert _tiers(server) == ["cpu"]
    assert "unreachable" in server.log()
