"""Blended prefill on a real SGLang server (SmolLM2-135M-Instruct, trained weights, float32).

A server with `enable_blending`, a disk tier, Redis and a recompute share of 1, then the same
server restarted (its segments then come from the disk), then a second instance with Redis
alone and no CPU tier (they come from Redis): every cached token is recomputed
from the check layer on, so a blend must answer exactly as a full prefill does, and any slip in
the plumbing (segments read from the wrong keys, keys rotated to the wrong positions, KV written
into the wrong slots, the device prefix misread) shows as another answer. The share's selection
itself is tested against a full prefill in tests/blend (quality: benchmarks/serving/bench_blend).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer
from kvtier.cli import tiers as cli_tiers
from kvtier.demo import texts
from tests.integration.sglang.conftest import kvtier_metrics, write_config

pytestmark = pytest.mark.sglang

ADMIN = "kvtier-blend-admin"
SEPARATOR = " # # "  # LMCache's default blend_special_str
SYSTEM = ("<|im_start|>system\nAnswer from the inventory records.<|im_end|>\n"
          "<|im_start|>user\nRecords:")
ASK = "Question: Which depot is listed first?<|im_end|>\n<|im_start|>assistant\n"
_rng = random.Random(7)
# Each document is 112-120 tokens (a whole chunk and a tail, segments of several chunks are
# tested in tests/blend): every prefill here runs on the real model, on a CPU.
DOC_TOKENS = 100  # at least, each
DOCS = [" ".join(texts.record(i, f) for i, f in enumerate(texts.facts(_rng, 6)))
        for _ in range(4)]


def _prompt(order: list[int]) -> str:
    return SYSTEM + SEPARATOR + "".join(DOCS[i] + SEPARATOR for i in order) + ASK


def _generate(server: SGLangServer, text: str, *, opt_out: bool = False,
              salt: str | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    if opt_out:
        params["custom_params"] = {"kvtier_blend": False}
    body: dict[str, Any] = {"text": text, "sampling_params": params}
    if salt is not None:
        body["cache_salt"] = salt  # its own keys and radix namespace: computed from scratch
    return server.post("/generate", body)


def _metric(server: SGLangServer, name: str, at_least: float = 0.0) -> float:
    """kvtier's counter `name` once it reaches `at_least` (the exporter syncs every second)."""
    deadline = time.monotonic() + 180  # a bound on a hang, not a timing assertion
    while (value := kvtier_metrics(server).get(f"kvtier_sglang_{name}_total", 0.0)) < at_least:
        assert time.monotonic() < deadline, f"{name} = {value} < {at_least}"
        time.sleep(0.5)
    return value


def _blends(server: SGLangServer) -> int:
    """Requests blended so far (the scheduler logs each before its reply)."""
    return len(re.findall(r"kvtier: blended \S+: ", server.log()))


BLENDED = re.compile(r"kvtier: blended \S+: (\d+) tokens from (\d+) segments at new positions, "
                     r"(\d+) of them recomputed from layer \d+, (\d+) computed \(device prefix "
                     r"(\d+)\)")


def _last_blend(server: SGLangServer) -> dict[str, int]:
    """The last blend's log line: tokens loaded from segments, segments, tokens of them
    recomputed, tokens computed, the device prefix."""
    found = BLENDED.findall(server.log())
    assert found, server.log()[-3000:]
    return dict(zip(("loaded", "segments", "recomputed", "computed", "device"),
                    map(int, found[-1])))


# A bound on a hang, not a timing: kvtier's own forward recomputes every blended token on the
# CPU (160 s in a full run, 270 s with the host's load at 10; pytest's default is 300 s).
@pytest.mark.timeout(900)
def test_segments_load_at_new_positions_and_blend_exactly_at_a_share_of_one(
        real_model: Path, start_server: Callable[..., SGLangServer], tmp_path: Path,
        redis_factory: Callable[..., RedisProcess]) -> None:
    redis = redis_factory()
    blending: dict[str, Any] = {"enable_blending": True, "blend_recompute_ratios": [1.0],
                                "blend_min_tokens": 64, "chunk_size": 64,
                                "max_local_cpu_size": 0.2}
    config = write_config(tmp_path / "blend.yaml", local_disk=str(tmp_path / "disk"),
                          max_local_disk_size=1.0, remote_url=redis.url, **blending)
    server = start_server(real_model, config, "--max-total-tokens", "8192", "--enable-metrics",
                          "--admin-api-key", ADMIN)
    first = _generate(server, _prompt([0, 1, 2, 3]))
    assert first["meta_info"]["cached_tokens"] == 0 and _blends(server) == 0
    # The four documents missed: each is computed alone in the background and stored.
    assert _metric(server, "blend_segments_stored", at_least=4) == 4

    shuffled = _prompt([2, 0, 3, 1])
    reference = _generate(server, shuffled, opt_out=True, salt="reference")
    assert reference["meta_info"]["cached_tokens"] == 0
    blended = _generate(server, shuffled)
    assert _blends(server) == 1 and _metric(server, "blend_requests", at_least=1) == 1
    assert _metric(server, "blend_segments_hit") == 4
    loaded = _metric(server, "blend_tokens_loaded")
    assert 4 * DOC_TOKENS < loaded < len(shuffled)
    # A share of 1: all of them but the segments' first tokens (computed as uncached are)
    assert loaded - 4 <= _metric(server, "blend_tokens_recomputed") < loaded
    # A share of 1 recomputes every loaded token: only the device prefix counts as cached.
    line = _last_blend(server)
    assert line["loaded"] == loaded and line["segments"] == 4
    assert blended["meta_info"]["cached_tokens"] == line["device"], (blended["meta_info"], line)
    assert blended["output_ids"] == reference["output_ids"], (blended["text"],
                                                              reference["text"])
    # every token past the check layer computed by SGLang's model in the blend's job, before
    # admission (rows_forward): exact, as the answer shows
    assert f"{int(loaded) + line['computed']} tokens past it in SGLang's model before " \
        "admission" in server.log(), server.log()[-3000:]

    # An opted-out request reads no blended KV: its device match stops at the first blended
    # slot, after the system prompt, and it is kept out of the tree, so a second one does too.
    for _ in range(2):
        private = _generate(server, shuffled, opt_out=True)
        assert private["meta_info"]["cached_tokens"] < 64
        assert private["output_ids"] == reference["output_ids"]
    assert server.log().count("read no blended KV") == 2
    # A verified request reads none either: blended KV under it would fail honest records.
    assert cli_tiers.request(server.url, {"op": "verify", "fraction": 1}, ADMIN)[0] == 200
    verified = _generate(server, shuffled)
    assert cli_tiers.request(server.url, {"op": "verify", "fraction": 0}, ADMIN)[0] == 200
    assert verified["meta_info"]["cached_tokens"] < 64 and _blends(server) == 1
    assert verified["output_ids"] == reference["output_ids"]
    assert server.log().count("read no blended KV") == 3
    # Its four segments' records were computed alone again and compared: all honest.
    assert _metric(server, "blend_segments_verified", at_least=4) == 4
    assert _metric(server, "blend_segments_mismatched") == 0

    # Blended KV never becomes a prefix record: after a flush the same prompt (opted out)
    # finds at most the exact system prompt before the first document.
    server.flush_cache()  # also waits for kvtier's background stores
    again = _generate(server, shuffled, opt_out=True)
    assert again["meta_info"]["cached_tokens"] < 64
    assert again["output_ids"] == reference["output_ids"]

    # A prompt without segments takes the prefix path alone and answers as before.
    plain = SYSTEM + DOCS[0] + ASK
    assert _generate(server, plain)["output_ids"] == \
        _generate(server, plain, opt_out=True, salt="plain")["output_ids"]
    assert _blends(server) == 1 and "Traceback" not in server.log()

    # After a restart the segments come from the disk: loaded into the CPU tier while the
    # request waits (prefetch_policy: wait_complete), then blended.
    server.stop()
    restarted = start_server(real_model, config, "--max-total-tokens", "8192",
                             "--enable-metrics")
    # A second instance that shares only Redis and keeps no CPU tier (local_cpu: false),
    # launched now: it starts while the restarted server serves.
    shared = write_config(tmp_path / "second.yaml", local_cpu=False, remote_url=redis.url,
                          **blending)
    second = start_server(real_model, shared, "--max-total-tokens", "8192", "--enable-metrics",
                          ready=False)
    other = _prompt([3, 1, 0, 2])
    reference = _generate(restarted, other, opt_out=True, salt="reference")
    assert _generate(restarted, other)["output_ids"] == reference["output_ids"]
    assert _blends(restarted) == 1 and _metric(restarted, "blend_segments_hit", at_least=4) == 4

    # The second instance: the segments the first server wrote are staged from Redis while
    # the request waits, then blended.
    restarted.stop()
    second.wait_ready()
    third = _prompt([1, 3, 2, 0])
    reference = _generate(second, third, opt_out=True, salt="reference")
    assert _generate(second, third)["output_ids"] == reference["output_ids"]
    assert _blends(second) == 1 and _metric(second, "blend_segments_hit", at_least=4) == 4
    assert "Traceback" not in second.log()


def test_a_reordered_rag_prompt_with_a_preamble_reuses_every_document(
        real_model: Path, start_server: Callable[..., SGLangServer], tmp_path: Path) -> None:
    """Issue 74: after a reorder only one of three documents was reused (the preamble had
    merged into the first document's segment), and `cached_tokens` counted the 730 tokens the
    blend computed as cached. With the preamble ended by the separator (docs/blending.md),
    every document is reused, and `cached_tokens` is the device prefix plus the tokens whose
    cached KV the blend kept: neither the tokens it computed nor those it recomputed.

    Issue 75: once a blend is measured, a request whose blend would lose to the full prefill
    (here any blend: `blend_max_prefill_ratio` is tiny) is computed instead, counted once and
    logged; the first blend runs unmeasured."""
    config = write_config(tmp_path / "blend.yaml", enable_blending=True, chunk_size=64,
                          blend_min_tokens=64, blend_recompute_ratios=[0.15],
                          max_local_cpu_size=0.2, blend_max_prefill_ratio=1e-9)
    server = start_server(real_model, config, "--max-total-tokens", "8192", "--enable-metrics")
    _generate(server, _prompt([0, 1, 2]))
    assert _metric(server, "blend_segments_stored", at_least=3) == 3
    server.flush_cache()  # no device prefix: every token past it comes from the blend
    reordered = _generate(server, _prompt([2, 0, 1]))
    line = _last_blend(server)
    # the counter reaches the exporter at its next sync (a fresh-clone CI run read 0 before it)
    assert line["segments"] == 3 and _metric(server, "blend_segments_hit", at_least=3) == 3, line
    assert line["device"] == 0, line
    # the check layers computed while the request waited, off the scheduler thread, and the
    # share past them by SGLang's own model there too (issue 75: no stream waits for them)
    said = re.findall(r"kvtier: blended \S+: .*\)$", server.log(), re.M)[-1]
    assert said.endswith("off the scheduler thread)"), said
    assert "in SGLang's model before admission on " in said, said
    assert line["loaded"] > 3 * DOC_TOKENS and line["computed"] < line["loaded"] / 4, line
    kept = line["loaded"] - line["recomputed"] - line["segments"]  # first tokens: computed
    assert 0 < kept < line["loaded"]
    meta = reordered["meta_info"]
    assert meta["cached_tokens"] == line["device"] + kept, (meta, line)
    assert meta["cached_tokens_details"]["host"] == kept, meta

    # Without the separator after it, the preamble and the first document are one segment,
    # which a reorder misses: the log says how to separate it.
    joined = SYSTEM + DOCS[1] + SEPARATOR + DOCS[2] + SEPARATOR + ASK
    computed = _generate(server, joined)
    assert server.log().count("end it with the separator too") == 1, server.log()[-3000:]
    # Its second document is held, but a blend now loses (the ratio): computed, not blended.
    assert _blends(server) == 1 and _metric(server, "blend_fallbacks_slower", at_least=1) == 1
    assert server.log().count("computed, not blended: a blend of") == 1
    assert computed["output_ids"] == _generate(server, joined, opt_out=True,
                                               salt="joined")["output_ids"]
    assert "Traceback" not in server.log()


# A bound on a hang (two ranks on two cores), not a timing.
@pytest.mark.timeout(900)
def test_tensor_parallel_ranks_blend_the_same_rows_and_answer_as_a_full_prefill(
        real_model: Path, start_server: Callable[..., SGLangServer], tmp_path: Path) -> None:
    # At --tp 2 each rank holds its own KV heads (SmolLM2's 3 padded to 4 by SGLang): its
    # segment records hold its columns of the model's KV, its check layer is computed from
    # the whole model's weights (gathered at start), and the ranks agree on every choice. A
    # share of 1 makes any slip (a rank's columns misplaced, weights gathered out of order,
    # ranks folding different rows) show as another answer, or a hang.
    config = write_config(tmp_path / "tp2.yaml", enable_blending=True,
                          blend_recompute_ratios=[1.0], blend_min_tokens=64, chunk_size=64,
                          max_local_cpu_size=0.2)
    server = start_server(real_model, config, "--tp", "2", "--max-total-tokens", "8192",
                          "--enable-metrics")
    assert _generate(server, _prompt([0, 1, 2, 3]))["meta_info"]["cached_tokens"] == 0
    # each rank computes the four documents alone and stores its columns of them
    assert _metric(server, "blend_segments_stored", at_least=8) == 8

    shuffled = _prompt([2, 0, 3, 1])
    reference = _generate(server, shuffled, opt_out=True, salt="reference")
    blended = _generate(server, shuffled)
    lines = BLENDED.findall(server.log())
    assert len(lines) == 2 and lines[0] == lines[1], lines  # one per rank, the same rows
    loaded, segments = int(lines[0][0]), int(lines[0][1])
    assert segments == 4 and 4 * DOC_TOKENS < loaded < len(shuffled)
    assert blended["output_ids"] == reference["output_ids"], (blended["text"],
                                                              reference["text"])
    assert server.log().count(" tokens past it in SGLang's forward") == 2
    assert "Traceback" not in server.log()
