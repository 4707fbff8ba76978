"""kvtier's own CUDA streams for one pool: stores and loads ordered by events, never by the host.

The copies go through `staging` (GPU buffers and the copy engines; the default) or the mapped
kernel alone (`KVTIER_GPU_COPY=mapped`). A store (`DeviceCopies.gather`) runs on the store
stream after an event: the one the caller recorded when it enqueued the forward that wrote the
KV, or else everything enqueued on the caller's current stream so far. It then waits for its own
copy on the calling thread (the engine's store runs on a background thread in a server), because
the objects it fills go into the CPU tier, where other threads read them, and the caller may
reuse the pool rows once this returns.

A load (`DeviceCopies.scatter`) never waits: the load stream first waits for the work already
enqueued on the caller's current stream (which may still read or write those rows), the copy is
enqueued, and the caller's stream waits for the copy's event, so the forward enqueued next reads
the loaded bytes. The objects it reads stay leased until that event has fired: a `Fence` thread
waits for it, releases them and reports slot errors the kernel found.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvtier.connectors.base import KVConnector
from kvtier.connectors.staging import Staging, copy_path
from kvtier.kernels.host_copy import STATUS_BAD
from kvtier.memory import MemoryObj
from kvtier.metrics import Counters, RateLimitedLog

__all__ = ["DeviceCopies", "Fence", "Waitable"]

logger = logging.getLogger(__name__)


class Waitable(Protocol):
    """What the fence waits on: a `torch.cuda.Event` (or a stand-in in tests)."""

    def synchronize(self) -> None: ...


_STOP = object()


class Fence:
    """Runs callbacks once their events have fired, in order, on one background thread.

    Events of one stream fire in the order they were recorded, so waiting for them in order
    loses nothing. A callback that raises is logged and does not stop the thread.
    """

    def __init__(self, name: str = "kv-gpu-fence"):
        self._jobs: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()  # no job is queued behind the stop marker
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def defer(self, event: Waitable, done: Callable[[], None]) -> None:
        """Call `done()` once `event` has fired (at once, on the caller's thread, if closed)."""
        with self._lock:
            if not self._closed:
                self._jobs.put((event, done))
                return
        event.synchronize()
        done()

    def pending(self) -> int:
        return self._jobs.unfinished_tasks

    def drain(self, timeout: float) -> bool:
        """Wait until every deferred callback has run; False if `timeout` ran out first."""
        done = self._jobs.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._jobs.unfinished_tasks, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Run what is queued, then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("kvtier: the GPU fence thread did not stop within %.1fs", timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                assert isinstance(job, tuple)
                event: Waitable = job[0]
                done: Callable[[], None] = job[1]
                event.synchronize()  # releases the GIL while it waits
                done()
            except Exception:  # a lost callback would leak arena memory: log, go on
                logger.exception("kvtier: a deferred GPU completion failed")
            finally:
                self._jobs.task_done()


class DeviceCopies:
    """Stores and loads between one CUDA pool (`connector`) and the pinned arena, on kvtier's
    own streams. Thread-safe: one call's stream waits and events do not depend on another's.

    Args:
        connector: over a CUDA pool.
        counters: `gpu_load_bad_slots` counts loads whose slots the kernel found out of range.
    """

    def __init__(self, connector: KVConnector, counters: Counters):
        if connector.device.type != "cuda":
            raise ValueError(f"DeviceCopies needs a CUDA pool, got one on {connector.device}")
        self.connector = connector
        self.device = connector.device
        self.store_stream = torch.cuda.Stream(self.device)
        self.load_stream = torch.cuda.Stream(self.device)
        self.staging = Staging(self.device) if copy_path() == "staged" else None
        self.fence = Fence()
        self._counters = counters
        counters.declare("gpu_load_bad_slots")
        self._warn = RateLimitedLog(logger)

    def gather(self, slot_runs: Sequence[torch.Tensor], objs: Sequence[MemoryObj],
               ready: torch.cuda.Event | None = None) -> list[int]:
        """Copy the KV of the slots in `slot_runs` (in order, one per token of `objs`) into
        `objs` once `ready` has fired (if None: once the caller's current stream has run what
        it holds now); waits for the copy on this thread and returns each chunk's status word
        (0: copied whole). `slot_runs` must be ready when `ready` is (views, not results of
        kernels enqueued after it): they are joined on the store stream."""
        status = torch.zeros(len(objs), dtype=torch.int32, pin_memory=True)
        stream = self.store_stream
        if ready is not None:
            stream.wait_event(ready)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            slots = slot_runs[0] if len(slot_runs) == 1 else torch.cat(list(slot_runs))
            self.connector.gather_host(slots, objs, status, self.staging)
            done = torch.cuda.Event(blocking=True)  # a waiter sleeps, not spins
            done.record(stream)
        for run in slot_runs:
            run.record_stream(stream)  # the caller may drop them before the copy has run
        done.synchronize()
        return status.tolist()

    def scatter(self, objs: Sequence[MemoryObj], slots: torch.Tensor) -> None:
        """Enqueue the copy of `objs` into the pool rows `slots` and make the caller's current
        stream wait for it; returns at once. `objs` are retained until the copy has run."""
        caller = torch.cuda.current_stream(self.device)
        stream = self.load_stream
        status = torch.zeros(len(objs), dtype=torch.int32, pin_memory=True)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            self.connector.scatter_host(objs, slots, status, self.staging)
            done = torch.cuda.Event(blocking=True)  # a waiter sleeps, not spins
            done.record(stream)
        caller.wait_event(done)
        held = [obj.retain() for obj in objs]
        self.fence.defer(done, lambda: self._loaded(held, status))

    def _loaded(self, held: list[MemoryObj], status: torch.Tensor) -> None:
        """Fence thread: a load's copy has run."""
        for obj in held:
            obj.release()
        if any(word & STATUS_BAD for word in status.tolist()):
            self._counters.inc("gpu_load_bad_slots")
            self._warn.warning("bad-load-slots", "kvtier: a load's slot_mapping held values "
                             "outside [-1, %d); those rows were not written (a bug in the "
                             "caller's slot mapping)", self.connector.num_slots)

    def drain(self, timeout: float) -> bool:
        """Wait until every enqueued load has run and released its objects."""
        return self.fence.drain(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self.fence.close(timeout)
