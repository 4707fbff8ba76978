"""The SGLang adapter's store thread: locks come back once the slots are read, a store still
queued at its deadline is cancelled (its lock freed), and nothing is handed back twice."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from kvtier.background import copy_threads
from kvtier.integration.sglang.rank.stores import StoreJob, StoreWorker
from kvtier.metrics import Counters

COUNTERS = ("sglang.stores_skipped_busy", "sglang.store_errors")


def _job(handle: str) -> StoreJob:
    return StoreJob(np.arange(16), torch.arange(16), handle)


class _Store:
    """A store that reads its slots, then waits for `finish` (the tier writes)."""

    def __init__(self, release_first: bool) -> None:
        self.release_first = release_first
        self.finish = threading.Event()
        self.started = threading.Event()
        self.ran: list[str] = []

    def __call__(self, job: StoreJob) -> int:
        self.ran.append(job.handle)
        if self.release_first:
            job.release_slots()
        self.started.set()
        assert self.finish.wait(60)
        return 16


def test_the_lock_comes_back_when_the_slots_are_read_not_when_stored() -> None:
    store = _Store(release_first=True)
    worker = StoreWorker(store, Counters(*COUNTERS))
    try:
        assert worker.submit(_job("a"))
        done = worker.collect(wait=True, timeout=60)
        assert [j.handle for j in done] == ["a"] and not store.finish.is_set()
        assert worker.pending() == 0
        store.finish.set()
        assert worker.drain(60) and done[0].stored == 16
    finally:
        store.finish.set()
        worker.close(10)


def test_a_store_still_queued_at_its_deadline_is_cancelled() -> None:
    store = _Store(release_first=False)  # "a" holds the thread while reading its slots
    counters = Counters(*COUNTERS)
    worker = StoreWorker(store, counters, deadline_s=0.0)
    try:
        assert worker.submit(_job("a"))
        assert store.started.wait(60)
        assert worker.submit(_job("b"))
        # "a" is reading (never cancelled); "b" is past its deadline and still queued.
        assert [j.handle for j in worker.collect()] == []  # jobs hand back in order
        cancelled = worker.collect(wait=True, timeout=0.0)
        assert [j.handle for j in cancelled] == ["b"]
        assert counters.snapshot()["sglang.stores_cancelled"] == 1
        store.finish.set()
        assert worker.drain(60)
        assert [j.handle for j in worker.collect()] == ["a"]
        assert store.ran == ["a"]  # the cancelled store never ran
        assert worker.collect() == [] and worker.pending() == 0
    finally:
        store.finish.set()
        worker.close(10)


def test_a_failing_store_still_hands_its_lock_back() -> None:
    def store(job: StoreJob) -> int:
        raise RuntimeError("tier on fire")

    counters = Counters(*COUNTERS)
    worker = StoreWorker(store, counters)
    try:
        assert worker.submit(_job("a"))
        done = worker.collect(wait=True, timeout=60)
        assert [j.handle for j in done] == ["a"] and isinstance(done[0].error, RuntimeError)
        assert counters.snapshot()["sglang.store_errors"] == 1
    finally:
        worker.close(10)


def test_submissions_past_the_limit_are_refused() -> None:
    store = _Store(release_first=False)
    counters = Counters(*COUNTERS)
    worker = StoreWorker(store, counters, max_pending=2)
    try:
        assert worker.submit(_job("a")) and worker.submit(_job("b"))
        assert not worker.submit(_job("c"))
        assert counters.snapshot()["sglang.stores_skipped_busy"] == 1
    finally:
        store.finish.set()
        worker.close(10)


def test_the_store_thread_keeps_its_priority_and_copies_alone() -> None:
    # A request may wait for a store to read its slots (they stay locked until then): the
    # store thread is not niced, but its copies never start a team beside the engine's.
    seen: list[tuple[int, int]] = []

    def store(job: StoreJob) -> int:
        seen.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                     copy_threads()))
        return 0

    worker = StoreWorker(store, Counters(*COUNTERS))
    try:
        assert worker.submit(_job("a"))
        assert len(worker.collect(wait=True, timeout=60)) == 1
    finally:
        worker.close(10)
    assert seen == [(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), 1)]
