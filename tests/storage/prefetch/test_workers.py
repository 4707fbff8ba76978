"""The prefetch workers on their own: a bounded queue that close does not run, loads taking
turns window by window, worker names the OS shows."""

from __future__ import annotations

import threading

from kvtier.storage.prefetch.handle import Prefetch
from kvtier.storage.prefetch.workers import Prefetcher
from tests.helpers import make_keys, os_thread_name


def test_prefetcher_is_bounded_and_close_does_not_run_the_queue() -> None:
    release = threading.Event()
    ran: list[Prefetch] = []
    dropped: list[int] = []

    def load(p: Prefetch) -> int | None:
        ran.append(p)
        release.wait(30)
        return 1

    pf = Prefetcher(load, workers=1, max_pending=2, on_dropped=lambda: dropped.append(1))
    running = Prefetch([])
    assert pf.submit(running)
    while not ran:  # the worker took it: the queue is empty again
        release.wait(0.001)
    queued = [Prefetch([]) for _ in range(2)]
    assert all(pf.submit(p) for p in queued)
    refused = Prefetch([])
    assert not pf.submit(refused)
    assert refused.done() and refused.result() == 0 and dropped == [1]
    release.set()
    pf.close(timeout=30)
    assert running.result(timeout=0) == 1
    assert len(ran) <= 3 and all(p.done() for p in queued)


def test_prefetches_take_turns_window_by_window() -> None:
    """One worker, two long loads: each gets a window in turn; neither waits for the other's
    whole prompt."""
    gate = threading.Event()
    turns: list[str] = []

    def step(p: Prefetch) -> int | None:
        gate.wait(30)
        turns.append(p.keys[0].key)
        p.position += 1
        return None if p.position < 3 else p.position

    pf = Prefetcher(step, workers=1)
    a, b = Prefetch(make_keys(48, seed=1)), Prefetch(make_keys(48, seed=2))
    assert pf.submit(a) and pf.submit(b)
    gate.set()
    assert a.result(timeout=30) == 3 and b.result(timeout=30) == 3
    ka, kb = a.keys[0].key, b.keys[0].key
    assert turns == [ka, kb, ka, kb, ka, kb]
    pf.close(timeout=30)


def test_prefetch_workers_show_their_names_to_the_os() -> None:
    seen: list[str] = []

    def step(p: Prefetch) -> int:
        seen.append(os_thread_name())
        return p.position

    pf = Prefetcher(step, workers=1)
    job = Prefetch(make_keys(16))
    assert pf.submit(job)
    job.result(timeout=30)
    pf.close(timeout=30)
    assert seen == ["kv-prefetch-0"]
