"""Shadow verification on real SGLang servers with the real model (SmolLM2-135M, float32, TP 1,
page 16, chunk 64): honest records of every tier match a fresh prefill, and a server whose
weights differ in one matrix, keyed under the first one's identity by a careless config, catches
the first one's records on its first verified hit, names the tier and the layer, removes them,
and answers with its own model. Verified by their tails (`verify_scope: tail`), honest records
load and match, and the changed model's tail takes the whole prompt out of every tier.

Records another server wrote (disk after a restart, Redis from a second instance, with and
without a CPU tier, at TP 1 and 2, at page sizes 1, 16 and 32 between them), verified with
verification switched on at run time: the quality gate (test_sglang_quality.py). A writer bug
(two token rows swapped under valid checksums): the engine's tests (tests/engine/test_verify.py),
on real CPU and disk tiers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from kvtier.cli import tiers as cli_tiers
from kvtier.cli.main import main as kvtier_main
from kvtier.demo.quality import Answer, ask, documents
from tests.integration.sglang.conftest import _LIVE, logged

pytestmark = pytest.mark.sglang

ADMIN = "kvtier-verify-admin"
CHANGED = "model.layers.3.self_attn.k_proj.weight"  # layer 3's keys: layers 0-2 stay the same
SERVED = "smollm2-shared-name"
PROMPTS = documents(2, facts=16, seed=5)  # about 360 tokens each: five chunks of 64


@pytest.fixture(scope="module")
def changed_model(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the real model whose layer-3 key projection is negated: a model that
    computes other KV from layer 3 on, as a fine-tune in place would."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("changed-model")
    for item in real_model.iterdir():
        if item.suffix != ".safetensors":
            (out / item.name).symlink_to(item)
    for weights in real_model.glob("*.safetensors"):
        tensors = load_file(weights)
        if CHANGED in tensors:
            tensors[CHANGED] = -tensors[CHANGED]
        save_file(tensors, out / weights.name, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory, redis_factory: Callable[..., RedisProcess],
           ) -> Iterator[Callable[..., SGLangServer]]:
    """`launch(model, name, **config)`: a server under the shared name and fingerprint, on one
    disk directory and one Redis; stopped (its writes drained) at the end."""
    root = tmp_path_factory.mktemp("verify")
    redis = redis_factory()
    started: list[SGLangServer] = []

    def start(model: Path, name: str, **values: object) -> SGLangServer:
        config = root / f"{name}.yaml"
        config.write_text(yaml.safe_dump({
            "chunk_size": 64, "max_local_cpu_size": 0.5, "prefetch_policy": "wait_complete",
            "local_disk": str(root / "disk"), "max_local_disk_size": 1.0,
            "remote_url": redis.url, "model_fingerprint": "shared", **values}))
        server = SGLangServer(model, root / f"{name}.log", args=[
            "--enable-kvtier", "--kvtier-config-file", str(config), "--page-size", "16",
            "--max-total-tokens", "4096", "--served-model-name", SERVED,
            "--admin-api-key", ADMIN])
        started.append(server)
        _LIVE.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop(timeout=30)
            _LIVE.remove(server)


def verified(server: SGLangServer) -> dict[str, dict[str, int]]:
    """Per tier, the chunks checked and mismatched so far (`GET /kvtier/tiers`, one rank)."""
    status, answer = cli_tiers.request(server.url, None, ADMIN)
    assert status == 200, answer
    (rank,) = answer["ranks"]
    return rank["verified"]


def mismatch_lines(server: SGLangServer) -> list[tuple[str, int]]:
    """(tier, first differing layer) of every mismatch the server logged."""
    found = re.findall(r"verification MISMATCH in tier (\w+): chunk \d+ .*? from layer (\d+) on",
                       server.log())
    return [(tier, int(layer)) for tier, layer in found]


class Honest:
    """The real model's answers (stored in every tier), what verifying them in full counted,
    and the answers of the same prompts verified by their tails (`verify_scope: tail`)."""

    def __init__(self, answers: dict[str, Answer], counts: dict[str, dict[str, int]],
                 chunks: int, tails: dict[str, Answer]):
        self.answers, self.counts, self.chunks, self.tails = answers, counts, chunks, tails


def tail_cut(prompt_tokens: int) -> int:
    """What a request verified by its tail loads: its hit (all but the prompt's last token,
    in whole pages) without the hit's last full chunk."""
    hit = (prompt_tokens - 1) // 16 * 16
    return hit - hit % 64 - 64


@pytest.fixture(scope="module")
def honest(real_model: Path, launch: Callable[..., SGLangServer]) -> Honest:
    """The real model's answers stored in every tier, then verified against every tier, with
    verification switched on at run time through `kvtier verify`."""
    server = launch(real_model, "honest")
    answers = {text: ask(server, text) for text in PROMPTS}  # misses: stored everywhere
    assert all(a.cached_tokens < 32 for a in answers.values())
    refused = cli_tiers.request(server.url, {"op": "verify", "fraction": 2}, ADMIN)
    assert refused[0] == 400 and "fraction" in str(refused[1]["ranks"]), refused
    assert cli_tiers.request(server.url, {"op": "verify", "fraction": 1})[0] == 401
    assert kvtier_main(["verify", "--server", server.url, "--admin-key", ADMIN,
                        "--fraction", "1"]) == 0
    server.flush_cache()  # the tiers keep the prompts; SGLang's own tree forgets them
    for text in PROMPTS:
        again = ask(server, text)  # verified: computed, not loaded, and compared
        assert again.cached_tokens < 32, again  # at most the shared heading, from the device
        assert again.ids == answers[text].ids, (text, again.text, answers[text].text)
    found = logged(server, r"kvtier: verified (\d+) chunks .*?: (\d+) mismatched", len(PROMPTS))
    assert all(int(bad) == 0 for _, bad in found), found
    assert not mismatch_lines(server)
    counts = verified(server)
    return Honest(answers, counts, sum(int(n) for n, _ in found), _tails(server))


def _tails(server: SGLangServer) -> dict[str, Answer]:
    """The same prompts verified by their tails: loaded, then one chunk computed and compared."""
    refused = cli_tiers.request(server.url, {"op": "verify", "scope": "head"}, ADMIN)
    assert refused[0] == 400 and "scope" in str(refused[1]["ranks"]), refused
    assert kvtier_main(["verify", "--server", server.url, "--admin-key", ADMIN,
                        "--scope", "tail"]) == 0
    server.flush_cache()
    tails = {text: ask(server, text) for text in PROMPTS}
    found = logged(server, r"kvtier: verified (\d+) chunks .*?: (\d+) mismatched",
                   2 * len(PROMPTS))[len(PROMPTS):]
    assert all(int(n) >= 1 and int(bad) == 0 for n, bad in found), found
    assert not mismatch_lines(server)
    return tails


@pytest.mark.timeout(600)
def test_honest_records_of_every_tier_match_a_fresh_prefill(honest: Honest) -> None:
    # every full chunk of both prompts, but the first of the second (its heading was in
    # SGLang's own tree: only what a request computes is compared)
    assert honest.chunks >= 4 * len(PROMPTS)
    for tier in ("cpu", "disk", "redis"):  # each chunk, in each tier
        assert honest.counts[tier] == {"checked": honest.chunks, "mismatched": 0}, honest.counts


@pytest.mark.timeout(600)
def test_scope_tail_loads_all_but_the_last_chunk_and_answers_the_same(honest: Honest) -> None:
    for text, answer in honest.tails.items():
        assert answer.cached_tokens == tail_cut(answer.prompt_tokens) >= 3 * 64, answer
        assert answer.ids == honest.answers[text].ids, (answer.text, honest.answers[text].text)


@pytest.mark.timeout(600)
def test_a_changed_model_under_the_same_identity_is_caught_and_answers_as_itself(
        changed_model: Path, honest: Honest, launch: Callable[..., SGLangServer]) -> None:
    server = launch(changed_model, "changed", verify_fraction=1.0)
    text = PROMPTS[0]
    first = ask(server, text)  # verified: its own prefill, compared with the first model's KV
    logged(server, r"kvtier: verified \d+ chunks", 1)
    found = mismatch_lines(server)
    assert sorted(found) == [("disk", 3), ("redis", 3)], found  # its CPU tier was empty
    counts = verified(server)
    assert counts["disk"]["mismatched"] == 1 and counts["redis"]["mismatched"] == 1, counts
    assert first.ids != honest.answers[text].ids  # another model: its answer is its own
    # The first model's records are gone and this model's stored in their place: with
    # verification off, this server loads its own KV and answers as it computes.
    assert kvtier_main(["verify", "--server", server.url, "--admin-key", ADMIN,
                        "--fraction", "0"]) == 0
    server.flush_cache()
    loaded = ask(server, text)
    assert loaded.cached_tokens >= 4 * 64, loaded
    assert loaded.ids == first.ids, (loaded.text, first.text)
    # Verified by its tail, a prompt whose records the first model wrote: the tail this
    # model computed over them matches no tier, so the whole prompt leaves every tier.
    assert kvtier_main(["verify", "--server", server.url, "--admin-key", ADMIN,
                        "--fraction", "1", "--scope", "tail"]) == 0
    other = PROMPTS[1]
    server.flush_cache()
    over_theirs = ask(server, other)  # loaded the first model's prefix
    assert over_theirs.cached_tokens == tail_cut(over_theirs.prompt_tokens), over_theirs
    purged = logged(server, r"verified \d+ chunks .*?; (\d+) records of its loaded prefix "
                            r"removed", 1)
    assert int(purged[0]) > 0, purged
    counts = verified(server)
    assert {tier: counts[tier]["mismatched"] for tier in counts} == {
        "cpu": 1, "disk": 2, "redis": 2}, counts  # the prefetch had brought them to the CPU
    server.flush_cache()
    own = ask(server, other)  # nothing held: computed, and stored
    assert own.cached_tokens < 32, own
    server.flush_cache()
    again = ask(server, other)  # its own records now: loaded, the tail matches
    assert again.cached_tokens == tail_cut(own.prompt_tokens) and again.ids == own.ids
    logged(server, r"kvtier: verified \d+ chunks", 3)
    after = verified(server)
    assert {tier: after[tier]["mismatched"] for tier in after} == {
        tier: counts[tier]["mismatched"] for tier in counts}, after
    assert all(after[tier]["checked"] == counts[tier]["checked"] + 1 for tier in after), after
