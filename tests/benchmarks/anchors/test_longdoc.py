"""The long-document QA benchmark's request sequences (benchmarks/anchors/bench_longdoc.py), sent to
the stdlib stand-in for SGLang of test_multiturn.py, which records every prompt it served."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from benchmarks.anchors.bench_longdoc import (
    Arms,
    Documents,
    Options,
    _summaries,
    miss_cost,
    parse_args,
    query_order,
)
from benchmarks.anchors.driver import Record
from benchmarks.anchors.report import build_rows
from benchmarks.anchors.servers import NONE, REDIS, session_cpu_s
from benchmarks.anchors.stats import summarize_blocks
from tests.benchmarks.anchors.test_multiturn import FakeSGLang

DOCS = Documents(documents=3, document_len=40, question_len=4, output_len=2, repeats=2,
                 miss_documents=2, miss_pairs=2)


def _started() -> FakeSGLang:
    server = FakeSGLang()
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    return server


@pytest.fixture()
def fakes() -> Iterator[tuple[FakeSGLang, FakeSGLang]]:
    servers = (_started(), _started())
    try:
        yield servers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def _doc(docs: Documents, doc_set: str, prompt: list[int]) -> int:
    """Which document of `doc_set` a prompt starts with (-1: none)."""
    for i in range(docs.documents if not doc_set.startswith("miss") else docs.miss_documents):
        if prompt[:docs.document_len] == docs.document(doc_set, i):
            return i
    return -1


def test_the_orders() -> None:
    assert query_order("tile", 3, 2) == [0, 1, 2, 0, 1, 2]
    assert query_order("interleave", 3, 2) == [0, 0, 1, 1, 2, 2]
    shuffled = query_order("random", 3, 2, seed=5)
    assert sorted(shuffled) == [0, 0, 1, 1, 2, 2]
    assert shuffled == query_order("random", 3, 2, seed=5)
    with pytest.raises(ValueError, match="unknown order"):
        query_order("zigzag", 3, 2)


def test_each_order_sends_its_warm_up_then_its_queries(
        fakes: tuple[FakeSGLang, FakeSGLang]) -> None:
    fake, _ = fakes
    orders = ("tile", "interleave", "random")
    Arms(Options(DOCS, orders)).orders(NONE, fake.url)
    seen = list(fake.seen)  # the stand-in records in the order requests finished
    per_order = 3 + 6
    assert len(seen) == len(orders) * per_order and len(fake.flushes) == len(orders)
    for k, order in enumerate(orders):
        chunk = seen[k * per_order:(k + 1) * per_order]
        sent = [_doc(DOCS, order, s.input_ids) for s in chunk]
        assert sent == [0, 1, 2] + query_order(order, 3, 2)
        # A flush before each order's warm-up, none between its warm-up and its queries.
        assert chunk[0].start >= fake.flushes[k]
        assert k + 1 == len(fake.flushes) or chunk[-1].end <= fake.flushes[k + 1]
        # Every query asks a new question: the document repeats, the prompt does not.
        assert len({tuple(s.input_ids) for s in chunk}) == per_order
    # Different orders never share a document.
    assert _doc(DOCS, "tile", seen[per_order].input_ids) == -1


def test_the_second_instance_skips_the_warm_up(fakes: tuple[FakeSGLang, FakeSGLang]) -> None:
    fake, _ = fakes
    Arms(Options(DOCS, ("tile",))).orders("second-instance", fake.url, warm=False)
    assert [_doc(DOCS, "tile", s.input_ids) for s in fake.seen] == query_order("tile", 3, 2)
    assert fake.flushes == []


def test_the_all_miss_run_alternates_and_never_repeats(
        fakes: tuple[FakeSGLang, FakeSGLang]) -> None:
    base, kv = fakes
    arms = Arms(Options(DOCS, ("tile",)))
    arms.all_miss(base.url, REDIS, kv.url)
    assert list(arms.phases) == [NONE, REDIS]
    assert list(arms.phases[NONE]) == list(arms.phases[REDIS]) == ["all-miss 1", "all-miss 2"]
    n1, n2 = base.seen[:2], base.seen[2:]
    a1, a2 = kv.seen[:2], kv.seen[2:]
    # none, kvtier, kvtier, none (pair 1 none first, pair 2 kvtier first)
    assert max(s.end for s in n1) <= min(s.start for s in a1)
    assert max(s.end for s in a2) <= min(s.start for s in n2)
    assert [s.input_ids for s in n1] == [s.input_ids for s in a1]  # the same documents ...
    assert [s.input_ids for s in n2] == [s.input_ids for s in a2]
    for server in (base, kv):  # ... but nothing twice on one server
        firsts = Counter(tuple(s.input_ids[:DOCS.document_len]) for s in server.seen)
        assert max(firsts.values()) == 1
    assert len(arms.writes_landed_s) == 2  # kvtier's writes landed after each of its blocks


def test_the_all_miss_blocks_pool_into_one_row_per_arm(
        fakes: tuple[FakeSGLang, FakeSGLang]) -> None:
    base, kv = fakes
    arms = Arms(Options(DOCS, ("tile",)))
    arms.orders(NONE, base.url)
    arms.all_miss(base.url, REDIS, kv.url)
    rows = build_rows(_summaries(arms))
    assert [(r.arm, r.group) for r in rows] == [
        (NONE, "tile warm-up"), (NONE, "tile query"), (NONE, "all-miss"), (REDIS, "all-miss")]
    pooled = rows[-1]
    assert pooled.summary.requests == 4  # both blocks of the kvtier side
    assert pooled.summary.cached_tokens == sum(x.cached_tokens for x in kv.seen)
    cost = miss_cost(arms, rows)
    assert cost is not None and cost["arm"] == REDIS
    assert [p["pair"] for p in cost["pairs"]] == ["all-miss 1", "all-miss 2"]
    assert cost["mean_ttft_ratio"] == pooled.mean_ratio
    assert cost["met"] == (max(pooled.mean_ratio, pooled.median_ratio,
                               pooled.seconds_ratio) <= 1.03)


def test_each_all_miss_block_counts_the_cpu_its_own_server_used(
        fakes: tuple[FakeSGLang, FakeSGLang]) -> None:
    base, kv = fakes
    arms = Arms(Options(DOCS, ("tile",)))
    used = {base.url: 0.0, kv.url: 0.0}

    def cpu(url: str) -> float:  # a server's CPU clock: 1 s per call to base, 1.5 s to kv
        used[url] += 1.0 if url == base.url else 1.5
        return used[url]

    arms.cpu = cpu
    arms.all_miss(base.url, REDIS, kv.url)
    # kv's clock is read before, after the block and after the landing flush
    assert arms.block_cpu_s == {NONE: {"all-miss 1": 1.0, "all-miss 2": 1.0},
                                REDIS: {"all-miss 1": 1.5, "all-miss 2": 1.5}}
    assert arms.landing_cpu_s == [1.5, 1.5]
    cost = miss_cost(arms, build_rows(_summaries(arms)))
    assert cost is not None and cost["cpu_s"] == {REDIS: 3.0, NONE: 2.0}
    assert cost["cpu_ratio"] == 1.5 and cost["landing_cpu_s"] == 3.0


def test_a_session_s_cpu_is_read_from_proc() -> None:
    burn = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.3: pass\nprint(1, flush=True)\n"
                             "time.sleep(30)"], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert burn.stdout is not None and burn.stdout.readline().strip() == b"1"
        assert (session_cpu_s(burn.pid) or 0) >= 0.3
    finally:
        burn.kill()
        burn.wait()
    assert session_cpu_s(burn.pid) is None  # no live process of it


def _rec(start: float, end: float) -> Record:
    return Record(0, 1, start, 0.1, end, 100, 0, [1, 2])


def test_pooled_blocks_count_their_own_time_not_the_pauses_between() -> None:
    blocks = [[_rec(0.0, 1.0), _rec(1.0, 2.0)], [_rec(10.0, 13.0)]]
    got = summarize_blocks(blocks)
    assert got.seconds == pytest.approx(5.0)  # 2 + 3, not 13
    assert got.input_tok_s == pytest.approx(300 / 5.0)
    assert got.output_tok_s == pytest.approx(6 / 5.0)
    assert got.requests == 3


def test_bad_orders_and_oversized_documents_are_usage_errors() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--orders", "tile,zigzag"])
    with pytest.raises(SystemExit):
        parse_args(["--document-len", "4096"])  # the small model's context is 4096
    assert parse_args([]).docs.document_len == 2048
