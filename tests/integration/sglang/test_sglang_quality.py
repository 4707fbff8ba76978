"""The quality gate: on a real model (SmolLM2-135M-Instruct, trained weights, float32), every
path a hit can take answers as a server without kvtier computing from scratch: the same greedy
tokens, log-probabilities of the first 16 within `LOGPROB_TOLERANCE`, and the first token's
top-20 distribution within KL `KL_LIMIT` (kvtier/demo/quality.py states and justifies both).

Paths: the CPU tier after `/flush_cache` (the prompt's partial last chunk included) and a
conversation's next turn (the previous turn's prompt and answer hit) at TP 1 (page sizes 1 and
16, chunk sizes 256 and 64) and TP 2 (page size 32, chunk size 64); the disk after a restart at
TP 1; Redis from a second instance at TP 2 (where one rank's missing records then make both
ranks load nothing) and at TP 1, page size 1. On those three, shadow verification is switched
on while the server runs (`kvtier verify`): every rank computes the prompts again and finds the
records another server wrote (disk; Redis, without a CPU tier) equal to what it computed. (A
server start at TP 2 costs over a minute on 2 cores, so the disk at TP 2 is left to
benchmarks/serving/bench_quality.py and, on a generated model, test_sglang_tiers.py.)
The reference server runs without kvtier and without SGLang's own prefix cache, so every
reference answer is computed from scratch. Servers start one at a time: a 2-core host starting
several SGLang servers at once took minutes for each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from kvtier.cli.main import main as kvtier_main
from kvtier.demo.quality import Answer, ask, compare, documents
from tests.integration.sglang.conftest import _LIVE, logged

pytestmark = pytest.mark.sglang

POOL = ("--max-total-tokens", "8192")
ADMIN = "kvtier-quality-admin"
# (TP, page size, chunk size): what the paths run at
SETUPS = {"tp1-page1-chunk256": (1, 1, 256), "tp1-page16-chunk64": (1, 16, 64),
          "tp2-page32-chunk64": (2, 32, 64)}
FOLLOW_UP = "\nQuestion: Which depot is listed first?\nAnswer:"
PROMPTS = documents(2, facts=24)  # about 530 tokens each


class Servers:
    """Servers of this module, launched together where they can be, stopped at its end."""

    def __init__(self, model: Path, root: Path) -> None:
        self.model, self.root = model, root
        self.started: list[SGLangServer] = []

    def make(self, name: str, setup: str | None, **tiers: object) -> SGLangServer:
        args: list[str] = [*POOL]
        if setup is not None:
            tp, page, chunk = SETUPS[setup]
            config = self.root / f"{name}.yaml"
            config.write_text(yaml.safe_dump({"chunk_size": chunk, "max_local_cpu_size": 0.5,
                                              "prefetch_policy": "wait_complete", **tiers}))
            args += ["--enable-kvtier", "--kvtier-config-file", str(config),
                     "--tp", str(tp), "--page-size", str(page), "--admin-api-key", ADMIN]
        else:
            args.append("--disable-radix-cache")  # every reference computed from scratch
        # at TP 2, kvtier's plugin names each rank's cores (SGLANG_CPU_OMP_THREADS_BIND)
        server = SGLangServer(self.model, self.root / f"{name}.log", args=args)
        self.started.append(server)
        _LIVE.append(server)
        return server

    def start(self, *servers: SGLangServer) -> None:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()

    def stop(self, server: SGLangServer) -> None:
        server.stop(timeout=30)  # a SIGTERM: kvtier drains its queued writes first
        self.started.remove(server)
        _LIVE.remove(server)


@pytest.fixture(scope="module")
def servers(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    fleet = Servers(real_model, tmp_path_factory.mktemp("quality"))
    try:
        yield fleet
    finally:
        for server in list(fleet.started):
            fleet.stop(server)


@pytest.fixture(scope="module")
def redis(redis_factory: Callable[..., RedisProcess]) -> RedisProcess:
    return redis_factory()


@pytest.fixture(scope="module")
def reference(servers: Servers) -> Callable[[str], Answer]:
    """The answer of a server without kvtier, computed once per prompt."""
    server = servers.make("reference", None)
    servers.start(server)
    answers: dict[str, Answer] = {}

    def answer(text: str) -> Answer:
        if text not in answers:
            answers[text] = ask(server, text)
            assert answers[text].cached_tokens == 0
        return answers[text]

    return answer


def gate(reference: Answer, got: Answer, path: str) -> None:
    agreement = compare(reference, got)
    assert agreement.ok, (f"{path}: {agreement}\nreference: {reference.text!r}\n"
                          f"got:       {got.text!r}")


def hit_floor(answer: Answer, page: int) -> int:
    """What a full hit loads: every prompt token but the last, in whole pages."""
    return (answer.prompt_tokens - 1) // page * page


@pytest.fixture(scope="module")
def disks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each setup's disk directory."""
    return {setup: str(tmp_path_factory.mktemp(setup)) for setup in SETUPS}


@pytest.mark.timeout(600)  # a server start on a busy 2-core host, and eight prefills
@pytest.mark.parametrize("setup", list(SETUPS))
def test_hits_from_the_cpu_tier_and_a_next_turn_answer_as_computed_from_scratch(
        setup: str, servers: Servers, redis: RedisProcess, disks: dict[str, str],
        reference: Callable[[str], Answer]) -> None:
    server = servers.make(setup, setup, local_disk=disks[setup], max_local_disk_size=1.0,
                          remote_url=redis.url)  # the disk and Redis rows start from here
    servers.start(server)
    tp, page, _ = SETUPS[setup]
    for text in PROMPTS:  # misses: kvtier stores, and changes nothing of what is computed
        miss = ask(server, text)
        assert miss.cached_tokens < 32  # at most the prompts' shared heading, from the device
        gate(reference(text), miss, "miss")
    server.flush_cache()
    for text in PROMPTS:  # the CPU tier, the partial last chunk (a tail) included
        hit = ask(server, text)
        assert hit.cached_tokens == hit_floor(hit, page), hit
        gate(reference(text), hit, "CPU tier after /flush_cache")
    server.flush_cache()
    follow = PROMPTS[0] + reference(PROMPTS[0]).text + FOLLOW_UP
    turn = ask(server, follow)  # the last turn's prompt and answer, from the CPU tier
    assert turn.cached_tokens >= hit_floor(reference(PROMPTS[0]), page) - page, turn
    gate(reference(follow), turn, "a conversation's next turn")
    assert server.log().count("kvtier: loaded ") >= (len(PROMPTS) + 1) * tp  # every rank
    servers.stop(server)  # a SIGTERM: kvtier drains its queued disk and Redis writes


def verified_at_run_time(server: SGLangServer, tp: int, reference: Callable[[str], Answer],
                         tiers: list[str]) -> None:
    """Shadow verification switched on while the server runs (`kvtier verify`, every rank):
    the prompts are computed again, not loaded, and every rank compares what it computed with
    its shard's records in `tiers` (written by another server): no mismatch, the same answers."""
    assert kvtier_main(["verify", "--server", server.url, "--admin-key", ADMIN,
                        "--fraction", "1"]) == 0
    server.flush_cache()
    for text in PROMPTS:
        again = ask(server, text)
        assert again.cached_tokens < 32, again  # computed: at most the shared heading
        gate(reference(text), again, "verified (computed, compared with every tier)")
    found = logged(server, r"kvtier: verified (\d+) chunks of .*? against (\[.*?\]): (\d+) "
                   r"mismatched", tp * len(PROMPTS))
    assert all(int(n) > 0 and held == str(tiers) and bad == "0" for n, held, bad in found), found


def _replay(servers: Servers, setup: str, name: str, path: str,
            reference: Callable[[str], Answer], verified: list[str],
            **tiers: object) -> SGLangServer:
    """A new server of `setup` with `tiers` only, after the setup's first server stopped:
    every prompt hits from those tiers and answers as computed from scratch; then, verified,
    every prompt is computed and matches the records of the `verified` tiers."""
    server = servers.make(f"{setup}-{name}", setup, **tiers)
    servers.start(server)
    tp, page, _ = SETUPS[setup]
    for text in PROMPTS:
        hit = ask(server, text)
        assert hit.cached_tokens == hit_floor(hit, page), (path, hit)
        gate(reference(text), hit, path)
    assert server.log().count("kvtier: loaded ") >= tp * len(PROMPTS)  # every rank
    verified_at_run_time(server, tp, reference, verified)
    return server


@pytest.mark.timeout(600)
def test_a_restart_hits_from_disk(servers: Servers, disks: dict[str, str],
                                  reference: Callable[[str], Answer]) -> None:
    """The TP 1 page-16 server above stopped; a server on its disk directory (no Redis: a hit
    comes from disk) starts with an empty CPU tier."""
    setup = "tp1-page16-chunk64"
    assert any(Path(disks[setup]).iterdir()), "the CPU-tier test of this setup stores first"
    servers.stop(_replay(servers, setup, "restarted", "disk after a restart", reference,
                         ["cpu", "disk"], local_disk=disks[setup], max_local_disk_size=1.0))


@pytest.mark.timeout(600)
def test_at_tp2_a_second_instance_hits_from_redis(
        servers: Servers, redis: RedisProcess, reference: Callable[[str], Answer]) -> None:
    """The TP 2 server above stopped; a second instance (no disk, no CPU tier: a hit comes from
    Redis) loads each rank's shard. Then rank 1's records go: the ranks agree to load nothing,
    and the answer is still right."""
    server = _replay(servers, "tp2-page32-chunk64", "second", "Redis from a second instance",
                     reference, ["redis"], local_cpu=False, remote_url=redis.url)
    admin = ["--server", server.url, "--admin-key", ADMIN]
    assert kvtier_main(["verify", *admin, "--fraction", "0"]) == 0  # loads again
    # The verified requests above stored what they computed (written where Redis lacks it).
    # The detach writes what is queued and stops the writes, so none lands after the delete.
    assert kvtier_main(["tiers", *admin, "detach", "redis"]) == 0
    logged(server, r"kvtier: detached tier redis", 2)  # each rank, once drained
    client = redis.client()
    shard_1 = list(client.scan_iter(match="kvtier/*/1of2/*", count=1000))
    assert shard_1 and any(client.scan_iter(match="kvtier/*/0of2/*", count=1000))
    client.delete(*shard_1)
    assert kvtier_main(["tiers", *admin, "attach", "redis"]) == 0  # every rank, or none
    server.flush_cache()
    loaded = server.log().count("kvtier: loaded ")
    alone = ask(server, PROMPTS[0])  # rank 0 holds every chunk, rank 1 none: MIN is nothing
    assert alone.cached_tokens < 32, alone
    assert server.log().count("kvtier: loaded ") == loaded
    gate(reference(PROMPTS[0]), alone, "rank 1's records gone")
    servers.stop(server)


@pytest.mark.timeout(600)
def test_at_tp1_page1_a_second_instance_hits_from_redis(
        servers: Servers, redis: RedisProcess, reference: Callable[[str], Answer]) -> None:
    """The TP 1 page-1 server above stopped; a second instance (no disk, no CPU tier) loads
    every prompt token but the last from Redis: two whole chunks and the tail after them."""
    servers.stop(_replay(servers, "tp1-page1-chunk256", "second", "Redis from a second instance",
                         reference, ["redis"], local_cpu=False, remote_url=redis.url))
