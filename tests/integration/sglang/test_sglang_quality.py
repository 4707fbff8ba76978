"""The quality gate: on a real model (SmolLM2-135M-Instruct, trained weights, float32), every
path a hit can take answers as a server without kvtier computing from scratch: the same greedy
tokens, log-probabilities of the first 16 within `LOGPROB_TOLERANCE`, and the first token's
top-20 distribution within KL `KL_LIMIT` (kvtier/demo/quality.py states and justifies both).

Every path runs at every setup: TP 1 at page sizes 1 and 16, TP 2 at 1 and 32 (each setup with
chunk size 64 or 256, both sizes at each TP).
Each setup has two servers. The first computes both prompts (misses) and hits them from its CPU
tier after `/flush_cache` (the partial last chunk included), then a conversation's next turn.
It writes through to disk and Redis, except that the disk is detached before the second prompt:
that prompt is in Redis only. The second server starts after the first stopped, on the same
disk directory and Redis: the first prompt hits from disk after a restart, the second from Redis
as a second instance would (without a CPU tier where the setup says so). Then shadow
verification is switched on while it runs (`kvtier verify`): every rank computes the prompts
again and finds the records the first server wrote equal to what it computed. At TP 2, page 32,
rank 1's records are then deleted and the ranks agree to load nothing. At TP 1 page 16 and TP 2
page 1 the first server blends too (a recompute share of 1): documents stored alone when a first
prompt missed them are loaded at new positions into a reordered prompt, and its answer is held
to the same gate.

The reference server runs without kvtier and without SGLang's own prefix cache, so every
reference answer is computed from scratch. Each test launches the server of the test after it
once its own server is ready (`Servers.ahead`): the next start's half a minute of imports runs
beside this test's requests instead of after them, one start at a time (a 2-core host starting
several SGLang servers at once took minutes for each). Each setup has a key namespace of its
own, so no server finds another setup's records.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from kvtier.cli.main import main as kvtier_main
from kvtier.demo import texts
from kvtier.demo.quality import Answer, ask, compare, documents
from tests.integration.sglang.conftest import _LIVE, kvtier_metrics, logged

pytestmark = pytest.mark.sglang

POOL = ("--max-total-tokens", "8192")
ADMIN = "kvtier-quality-admin"


class Setup(NamedTuple):
    """What the paths run at; `cpu_tier`: whether the second server has a CPU tier; `blend`:
    whether the first server blends too (`enable_blending`, a recompute share of 1)."""

    tp: int
    page: int
    chunk: int
    cpu_tier: bool
    blend: bool = False


# Page 1 at each TP (SGLang's default), a larger page at each; both chunk sizes at each TP, a
# second server with and without a CPU tier at each. Each setup costs two servers and a minute
# or two of the suite: page 16 at TP 2 and page 32 at TP 1 add no path the four lack.
SETUPS = {"tp1-page1-chunk256": Setup(1, 1, 256, cpu_tier=False),
          "tp1-page16-chunk64": Setup(1, 16, 64, cpu_tier=True, blend=True),
          "tp2-page1-chunk64": Setup(2, 1, 64, cpu_tier=True, blend=True),
          "tp2-page32-chunk256": Setup(2, 32, 256, cpu_tier=False)}
FOLLOW_UP = "\nQuestion: Which depot is listed first?\nAnswer:"
PROMPTS = documents(2, facts=24)  # about 530 tokens each
# Blending: a preamble and three documents of about 115 tokens, each ended by LMCache's default
# separator, then a question; asked in one order, then in another (docs/blending.md).
SEPARATOR = " # # "
_rng = random.Random(3)
_DOCS = [" ".join(texts.record(i, f) for i, f in enumerate(texts.facts(_rng, 6)))
         for _ in range(3)]
BLEND = {"enable_blending": True, "blend_recompute_ratios": [1.0], "blend_min_tokens": 64}


def blend_prompt(order: list[int]) -> str:
    return ("Answer from the inventory records." + SEPARATOR
            + "".join(_DOCS[i] + SEPARATOR for i in order)
            + "Question: Which depot is listed first?\nAnswer:")


class Servers:
    """Servers of this module, launched together where they can be, stopped at its end."""

    def __init__(self, model: Path, root: Path) -> None:
        self.model, self.root = model, root
        self.started: list[SGLangServer] = []
        self.launched: dict[str, SGLangServer] = {}  # ahead of the test that takes them

    def make(self, name: str, setup: str | None, **tiers: object) -> SGLangServer:
        args: list[str] = [*POOL]
        if setup is not None:
            tp, page, chunk = SETUPS[setup][:3]
            config = self.root / f"{name}.yaml"
            config.write_text(yaml.safe_dump({"chunk_size": chunk, "max_local_cpu_size": 0.5,
                                              "prefetch_policy": "wait_complete",
                                              "key_namespace": setup, **tiers}))
            args += ["--enable-kvtier", "--kvtier-config-file", str(config),
                     "--tp", str(tp), "--page-size", str(page), "--admin-api-key", ADMIN]
            if tiers.get("enable_blending"):
                args.append("--enable-metrics")  # the segments' stores are counted there
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

    def ahead(self, name: str, setup: str, **tiers: object) -> None:
        """Launch server `name` now, for a later `take`."""
        if name not in self.launched:
            self.launched[name] = server = self.make(name, setup, **tiers)
            server.launch()

    def take(self, name: str, setup: str, **tiers: object) -> SGLangServer:
        """Server `name`, launched ahead or now, once it is ready."""
        server = self.launched.pop(name, None)
        if server is None:
            self.ahead(name, setup, **tiers)
            server = self.launched.pop(name)
        server.wait_ready()
        return server

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


def take_server(servers: Servers, setup: str, second: bool, disks: dict[str, str],
                redis: RedisProcess) -> SGLangServer:
    """The first (or `second`) server of `setup`, ready; the next test's is launched behind
    it. The tests run every setup's first server, then every setup's second server."""
    order = [(s, False) for s in SETUPS] + [(s, True) for s in SETUPS]

    def spec(setup: str, second: bool) -> tuple[str, dict[str, object]]:
        tiers: dict[str, object] = {"local_disk": disks[setup], "max_local_disk_size": 1.0,
                                    "remote_url": redis.url}
        if second:  # on the first server's disk directory and Redis, started after it stopped
            return f"{setup}-second", {"local_cpu": SETUPS[setup].cpu_tier, **tiers}
        return setup, {**tiers, **(BLEND if SETUPS[setup].blend else {})}

    name, tiers = spec(setup, second)
    server = servers.take(name, setup, **tiers)
    at = order.index((setup, second))
    if at + 1 < len(order):
        next_setup, next_second = order[at + 1]
        next_name, next_tiers = spec(next_setup, next_second)
        servers.ahead(next_name, next_setup, **next_tiers)
    return server


def detach(server: SGLangServer, tier: str, tp: int) -> None:
    """Detaches `tier` on every rank; each writes what it has queued for it first."""
    done = server.log().count(f"kvtier: detached tier {tier}")
    assert kvtier_main(["tiers", "--server", server.url, "--admin-key", ADMIN,
                        "detach", tier]) == 0
    logged(server, rf"kvtier: detached tier {tier}\b", done + tp)  # each rank, once drained


@pytest.mark.timeout(600)  # a server start on a busy 2-core host, and five prefills
@pytest.mark.parametrize("setup", list(SETUPS))
def test_hits_from_the_cpu_tier_and_a_next_turn_answer_as_computed_from_scratch(
        setup: str, servers: Servers, redis: RedisProcess, disks: dict[str, str],
        reference: Callable[[str], Answer]) -> None:
    """The first server of `setup`. It writes through to disk and Redis; the disk is detached
    once the first prompt is stored, so the second reaches Redis only."""
    server = take_server(servers, setup, False, disks, redis)
    tp, page = SETUPS[setup].tp, SETUPS[setup].page
    for n, text in enumerate(PROMPTS):
        miss = ask(server, text)  # kvtier stores, and changes nothing of what is computed
        assert miss.cached_tokens < 32, miss  # at most the prompts' shared heading
        gate(reference(text), miss, "miss")
        server.flush_cache()
        hit = ask(server, text)  # the CPU tier, the partial last chunk (a tail) included
        assert hit.cached_tokens == hit_floor(hit, page), hit
        gate(reference(text), hit, "CPU tier after /flush_cache")
        if n == 0:  # stored, so its disk writes are queued: the detach writes them first
            detach(server, "disk", tp)
    server.flush_cache()
    follow = PROMPTS[0] + reference(PROMPTS[0]).text + FOLLOW_UP
    turn = ask(server, follow)  # the last turn's prompt and answer, from the CPU tier
    assert turn.cached_tokens >= hit_floor(reference(PROMPTS[0]), page) - page, turn
    gate(reference(follow), turn, "a conversation's next turn")
    assert server.log().count("kvtier: loaded ") >= (len(PROMPTS) + 1) * tp  # every rank
    if SETUPS[setup].blend:
        blended_as_computed(server, tp, reference)
    servers.stop(server)  # a SIGTERM: kvtier drains its queued Redis writes


def blended_as_computed(server: SGLangServer, tp: int,
                        reference: Callable[[str], Answer]) -> None:
    """Blending (issue 75) at a share of 1: the documents, stored alone as segments when a
    first prompt missed them, load at new positions in a reordered prompt, SGLang's forward
    recomputes every loaded token on every rank, and the answer is the reference's."""
    first = ask(server, blend_prompt([0, 1, 2]))
    gate(reference(blend_prompt([0, 1, 2])), first, "blending: every segment missed")
    deadline = time.monotonic() + 120  # a bound on a hang, not a timing assertion
    while kvtier_metrics(server).get("kvtier_sglang_blend_segments_stored_total", 0) < 3 * tp:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.5)
    server.flush_cache()
    blended = blend_prompt([2, 0, 1])
    got = ask(server, blended)
    logged(server, r"kvtier: blended \S+: \d+ tokens from 3 segments at new positions", tp)
    gate(reference(blended), got, f"blended at new positions, TP {tp}")


def verified_at_run_time(server: SGLangServer, setup: Setup,
                         reference: Callable[[str], Answer], held: list[list[str]]) -> None:
    """Shadow verification switched on while the server runs (`kvtier verify`, every rank):
    the prompts are computed again, not loaded, and every rank compares each full chunk it
    computed (the one holding the shared heading the device kept included) with its shard's
    records in the tiers `held[n]` says hold prompt n: no mismatch, the same answers."""
    assert kvtier_main(["verify", "--server", server.url, "--admin-key", ADMIN,
                        "--fraction", "1"]) == 0
    server.flush_cache()
    for text in PROMPTS:
        again = ask(server, text)
        assert again.cached_tokens < 32, again  # computed: at most the shared heading
        gate(reference(text), again, "verified (computed, compared with every tier)")
    found = logged(server, r"kvtier: verified (\d+) chunks of a (\d+)-token prefix against "
                   r"(\[.*?\]): (\d+) mismatched", setup.tp * len(PROMPTS))
    assert all(int(n) == int(length) // setup.chunk and bad == "0"
               for n, length, _, bad in found), found
    assert sorted(tiers for *_, tiers, _ in found) == sorted(map(str, held * setup.tp)), found


@pytest.mark.timeout(600)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_restart_hits_from_disk_and_a_second_instance_from_redis(
        setup: str, servers: Servers, redis: RedisProcess, disks: dict[str, str],
        reference: Callable[[str], Answer]) -> None:
    """A server on the disk directory and Redis of the setup's first server, started after it
    stopped: the first prompt hits from disk, the second (never written to disk) from Redis."""
    assert any(Path(disks[setup]).iterdir()), "the setup's first server stores first"
    tp, page, _, cpu_tier, _ = SETUPS[setup]
    server = take_server(servers, setup, True, disks, redis)
    for text, path in zip(PROMPTS, ("disk after a restart", "Redis from a second instance")):
        hit = ask(server, text)
        assert hit.cached_tokens == hit_floor(hit, page), (path, hit)
        gate(reference(text), hit, path)
    assert server.log().count("kvtier: loaded ") >= tp * len(PROMPTS)  # every rank
    cpu = ["cpu"] if cpu_tier else []  # a CPU tier keeps what was loaded
    verified_at_run_time(server, SETUPS[setup], reference,
                         [[*cpu, "disk", "redis"], [*cpu, "redis"]])
    if tp == 2 and page == 32:
        _verified_by_tails(server, SETUPS[setup], reference)
        _one_rank_without_records_loads_nothing(server, redis, setup, reference)
    servers.stop(server)


def _verified_by_tails(server: SGLangServer, setup: Setup,
                       reference: Callable[[str], Answer]) -> None:
    """`verify_scope: tail` at TP 2 without a CPU tier: both ranks prefetch and load all but
    the hit's last full chunk, compute that chunk and find it equal to their shard's records."""
    assert kvtier_main(["verify", "--server", server.url, "--admin-key", ADMIN,
                        "--scope", "tail"]) == 0
    server.flush_cache()
    for text in PROMPTS:
        again = ask(server, text)
        hit = hit_floor(again, setup.page)
        assert again.cached_tokens == hit - hit % setup.chunk - setup.chunk, again
        gate(reference(text), again, "verified by its tail (loaded, its last chunk computed)")
    found = logged(server, r"kvtier: verified (\d+) chunks .*?: (\d+) mismatched",
                   2 * setup.tp * len(PROMPTS))[setup.tp * len(PROMPTS):]
    assert all(int(n) >= 1 and bad == "0" for n, bad in found), found


def _one_rank_without_records_loads_nothing(server: SGLangServer, redis: RedisProcess,
                                             setup: str,
                                             reference: Callable[[str], Answer]) -> None:
    """Rank 1's records go: the ranks agree to load nothing, and the answer is still right."""
    assert not SETUPS[setup].cpu_tier  # else rank 0's CPU tier would keep what it loaded
    admin = ["--server", server.url, "--admin-key", ADMIN]
    assert kvtier_main(["verify", *admin, "--fraction", "0"]) == 0  # loads again
    # The verified requests stored what they computed where it was missing (the second prompt,
    # on disk). The detaches write what is queued and stop the writes, so none lands after the
    # delete; the disk stays detached: Redis alone holds the prompts.
    detach(server, "disk", 2)
    detach(server, "redis", 2)
    client = redis.client()
    shard_1 = list(client.scan_iter(match=f"kvtier/*/{setup}/*/1of2/*", count=1000))
    assert shard_1 and any(client.scan_iter(match=f"kvtier/*/{setup}/*/0of2/*", count=1000))
    client.delete(*shard_1)
    assert kvtier_main(["tiers", *admin, "attach", "redis"]) == 0  # every rank, or none
    server.flush_cache()
    loaded = server.log().count("kvtier: loaded ")
    alone = ask(server, PROMPTS[0])  # rank 0 holds every chunk, rank 1 none: MIN is nothing
    assert alone.cached_tokens < 32, alone
    assert server.log().count("kvtier: loaded ") == loaded
    gate(reference(PROMPTS[0]), alone, "rank 1's records gone")
