"""The CPU side of the GPU path: the fence that holds a load's arena objects until its copy has
run, and the choice of path. Real CUDA streams and events are tested in tests/gpu/."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.connectors.streams import DeviceCopies, Fence
from kvtier.engine import CacheEngine
from kvtier.memory import KVLayout, MemoryAllocator
from kvtier.metrics import Counters


class FakeEvent:
    """Fires when the test says so, like a CUDA event whose copy is still running."""

    def __init__(self) -> None:
        self._fired = threading.Event()

    def fire(self) -> None:
        self._fired.set()

    def synchronize(self) -> None:
        assert self._fired.wait(10), "event never fired"


def test_the_fence_runs_callbacks_only_after_their_events_in_order() -> None:
    fence = Fence(name="kv-test-fence")
    ran: list[int] = []
    events = [FakeEvent() for _ in range(3)]
    for i, event in enumerate(events):
        fence.defer(event, lambda i=i: ran.append(i))
    assert not fence.drain(0.05) and ran == [] and fence.pending() == 3
    events[0].fire()
    events[2].fire()
    assert not fence.drain(0.05)
    assert ran == [0]  # the second copy still runs: the third waits behind it
    events[1].fire()
    assert fence.drain(5) and ran == [0, 1, 2] and fence.pending() == 0
    fence.close()


def test_a_failing_callback_does_not_stop_the_fence(caplog: pytest.LogCaptureFixture) -> None:
    fence = Fence(name="kv-test-fence")
    ran: list[str] = []
    first, second = FakeEvent(), FakeEvent()
    fence.defer(first, lambda: 1 / 0)  # type: ignore[func-returns-value]
    fence.defer(second, lambda: ran.append("second"))
    first.fire()
    second.fire()
    assert fence.drain(5) and ran == ["second"]
    assert "deferred GPU completion failed" in caplog.text
    fence.close()


def test_a_closed_fence_runs_queued_work_then_runs_new_work_inline() -> None:
    fence = Fence(name="kv-test-fence")
    ran: list[str] = []
    queued = FakeEvent()
    fence.defer(queued, lambda: ran.append("queued"))
    queued.fire()
    fence.close()
    assert ran == ["queued"]
    late = FakeEvent()
    late.fire()
    fence.defer(late, lambda: ran.append("late"))
    assert ran == ["queued", "late"]


def test_fence_releases_leased_arena_objects_when_the_event_fires() -> None:
    layout = KVLayout.mha(2, 1, 8, torch.float16)
    arena = MemoryAllocator(1 << 16, pin=False)
    obj = arena.allocate(layout, 4)
    assert obj is not None
    held = obj.retain()
    obj.release()  # the caller's lease ends at once; the copy still reads the bytes
    fence = Fence(name="kv-test-fence")
    event = FakeEvent()
    fence.defer(event, held.release)
    assert arena.used_bytes > 0
    event.fire()
    assert fence.drain(5) and arena.used_bytes == 0
    arena.check_integrity()
    fence.close()


def test_cpu_pools_take_the_cpu_path_and_device_copies_refuse_them() -> None:
    k = [torch.zeros(16, 1, 8, dtype=torch.float16) for _ in range(2)]
    conn = SGLangMHAConnector(k, [t.clone() for t in k])
    with pytest.raises(ValueError, match="needs a CUDA pool.*cpu"):
        DeviceCopies(conn, Counters())
    cfg = Config(chunk_size=16, max_local_cpu_size=0.001)
    with CacheEngine(cfg, model_name="m", layout=conn.layout, connector=conn) as engine:
        assert engine._device is None
