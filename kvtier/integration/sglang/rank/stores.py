"""Background stores of finished requests, for one SGLang TP rank.

Gathering a long prefix out of the pool is a large memory copy the scheduler must not wait for,
so it runs on one store thread. The slots a store reads stay valid because the scheduler pins
them (a tree lock) until the store says its slots are read; the rest of the store (the CPU-tier
put, the hand-off to the disk and Redis writers) runs after that, with the lock already free.
Locks are released on the scheduler thread (`collect()`), since SGLang's tree is not
thread-safe.

Admission never waits on this thread: a store still queued at its deadline
(`deadline_s` after submission) is cancelled and handed back, so its lock is freed; it is
counted and logged. A store already reading its slots is a memory copy and is let finish.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.background import copy_alone
from kvtier.metrics import Counters, RateLimitedLog

if TYPE_CHECKING:
    from kvtier.engine.hints import Hints
    from kvtier.integration.sglang.boundary.sglang_views import Opaque
    from kvtier.integration.sglang.rank.request_state import VerifyCut

__all__ = ["StoreJob", "StoreWorker", "MAX_PENDING_STORES", "STORE_DEADLINE_S"]

logger = logging.getLogger(__name__)

MAX_PENDING_STORES = 64
STORE_DEADLINE_S = 1.0
_STOP = object()

QUEUED, READING, READ, CANCELLED = "queued", "reading", "read", "cancelled"


@dataclass(eq=False)
class StoreJob:
    """One finished request's prefix to store; `handle` is what the caller pinned."""

    token_ids: np.ndarray
    slots: torch.Tensor
    handle: Opaque  # what SGLang's tree returned for the lock (passed back to it unread)
    # on GPUs, the CUDA event recorded after the forward that wrote the KV
    ready: torch.cuda.Event | None = None
    session_id: str | None = None  # pin the prefix for this SGLang session
    salt: str = ""  # the request's cache_salt
    prompt_len: int | None = None  # the prompt alone, whose tail is stored too
    verify: VerifyCut | None = None  # shadow verification: compare from its start, then store
    known: int = 0  # leading tokens the request found in the tiers (`CacheEngine.store`)
    hints: Hints | None = None  # the request's lifecycle hints (`kvtier.engine.hints`)
    deadline: float = 0.0  # monotonic; a job still queued then is cancelled
    state: str = QUEUED
    stored: int = 0
    error: BaseException | None = field(default=None, repr=False)
    slots_free: threading.Event = field(default_factory=threading.Event, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def start_reading(self) -> bool:
        """Store thread: claim the job; False if the scheduler cancelled it first."""
        with self.lock:
            if self.state != QUEUED:
                return False
            self.state = READING
            return True

    def cancel(self) -> bool:
        """Scheduler thread: cancel the job if it has not started; True if it was."""
        with self.lock:
            if self.state != QUEUED:
                return False
            self.state = CANCELLED
        self.slots_free.set()
        return True

    def release_slots(self) -> None:
        """The slots are no longer read (read, or the store failed before reading)."""
        with self.lock:
            if self.state == READING:
                self.state = READ
        self.slots_free.set()


Store = Callable[[StoreJob], int]


class StoreWorker:
    """Runs `store(job)` for submitted jobs on one thread, in order.

    `store` must call `job.release_slots()` as soon as it no longer reads `job.slots`; the
    worker calls it again when `store` returns or raises.
    """

    def __init__(self, store: Store, counters: Counters, *,
                 deadline_s: float = STORE_DEADLINE_S, max_pending: int = MAX_PENDING_STORES):
        self._store = store
        self._counters = counters
        counters.declare("sglang.stores_cancelled")
        self._warn = RateLimitedLog(logger)
        self.deadline_s = deadline_s
        self._max_pending = max_pending
        self._jobs: queue.Queue[StoreJob | object] = queue.Queue()  # or _STOP
        # Submitted and not yet handed back, oldest first (scheduler thread only).
        self._outstanding: dict[int, StoreJob] = {}
        self._thread = threading.Thread(target=self._run, name="kvtier-sglang-store",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: StoreJob) -> bool:
        """Queue `job` (scheduler thread); False when `max_pending` stores are outstanding."""
        if len(self._outstanding) >= self._max_pending:
            self._counters.inc("sglang.stores_skipped_busy")
            return False
        job.deadline = time.monotonic() + self.deadline_s
        self._outstanding[id(job)] = job
        self._jobs.put(job)
        return True

    def pending(self) -> int:
        return len(self._outstanding)

    def collect(self, *, wait: bool = False, timeout: float = 0.0) -> list[StoreJob]:
        """Jobs whose slots are free now: read, failed, or cancelled because they were still
        queued at their deadline (scheduler thread). With `wait` (the server is idle, e.g.
        `/flush_cache`), first wait up to `timeout` seconds in all for the jobs to read their
        slots, so that nothing is cancelled unless the store thread is stuck."""
        out: list[StoreJob] = []
        limit = time.monotonic() + timeout
        for key, job in list(self._outstanding.items()):
            if wait and not job.slots_free.is_set():
                job.slots_free.wait(max(0.0, limit - time.monotonic()))
            if not job.slots_free.is_set() and time.monotonic() >= job.deadline and job.cancel():
                self._counters.inc("sglang.stores_cancelled")
                self._warn.warning("store-deadline", "kvtier: a store of %d tokens was still "
                                   "queued %.1fs after its request finished; cancelled it so "
                                   "its KV slots are free (the store thread is behind)",
                                   len(job.token_ids), time.monotonic() - job.deadline +
                                   self.deadline_s)
            if not job.slots_free.is_set():
                if not wait:
                    break  # jobs run in order: the later ones are not done either
                continue
            del self._outstanding[key]
            out.append(job)
        return out

    def drain(self, timeout: float) -> bool:
        """Wait until every queued job has finished all of its work (not just read its
        slots); False if `timeout` ran out."""
        deadline = time.monotonic() + timeout
        done = self._jobs.all_tasks_done
        with done:
            while self._jobs.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                done.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Stop after the queued jobs (bounded by `timeout`)."""
        self._jobs.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("kvtier: the store thread did not stop within %.1fs", timeout)

    def _run(self) -> None:
        # Not niced: until a store has read its slots they stay locked, and in a full pool the
        # next request's admission waits for them. Its copy takes one core, never the engine's.
        copy_alone()
        while True:
            job = self._jobs.get()
            try:
                if not isinstance(job, StoreJob):  # _STOP
                    return
                self._run_one(job)
            finally:
                self._jobs.task_done()

    def _run_one(self, job: StoreJob) -> None:
        if not job.start_reading():
            return  # cancelled at its deadline; already handed back
        try:
            job.stored = self._store(job)
        except Exception as exc:  # a failed store is a miss later, never a crash now
            job.error = exc
            self._counters.inc("sglang.store_errors")
            logger.warning("kvtier: background store failed: %r", exc)
        finally:
            job.release_slots()
