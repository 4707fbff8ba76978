"""A real SGLang server with kvtier and `--kv-events-config`, and a ZMQ subscriber: a stored
prompt's device events come with `CPU_PINNED`, `DISK` and `EXTERNAL` (Redis) events naming the
same block hashes, and the CPU tier's evictions come as `BlockRemoved(CPU_PINNED)`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.redis import RedisProcess
from harness.sglang_server import SGLangServer, free_port
from tests.integration.sglang.conftest import CHUNK, prompt, write_config

pytestmark = pytest.mark.sglang

PAGE = 16
PROMPT = 12 * CHUNK
WAIT_S = 60.0  # a bound on a hang: events come within a publishing step or a write


class Subscriber:
    """Every KV event the server publishes, decoded, as it arrives."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 100)
        self._socket.connect(endpoint)
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                _, _, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            self.events.extend(self._decoder.decode(payload).events)

    def hashes(self, kind: str, medium: str) -> set[int]:
        return {h for e in list(self.events) if type(e).__name__ == kind
                and e.medium == medium for h in e.block_hashes}

    def wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, f"no {what} after {WAIT_S} s: {self.events}"
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(0)


def _serve(model: Path, tmp: Path, **config: Any) -> tuple[SGLangServer, Subscriber]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    path = write_config(tmp / "kvtier.yaml", local_disk=str(tmp / "disk"),
                        max_local_disk_size=0.1, **config)
    server = SGLangServer(model, tmp / "server.log", args=[
        "--enable-kvtier", "--kvtier-config-file", str(path), "--page-size", str(PAGE),
        "--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": endpoint,
                                          "bind": True, "topic": "kv"})])
    server.start()
    return server, Subscriber(endpoint)


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory,
           redis_factory: Callable[..., RedisProcess],
           ) -> Iterator[tuple[SGLangServer, Subscriber]]:
    # a CPU tier of a few prompts, so that more prompts evict the first
    server, subscriber = _serve(tiny_llama, tmp_path_factory.mktemp("tier-events"),
                                max_local_cpu_size=0.002, remote_url=redis_factory().url)
    try:
        yield server, subscriber
    finally:
        subscriber.close()
        server.kill()


def test_the_tiers_publish_the_device_s_block_hashes_and_their_evictions(
        served: tuple[SGLangServer, Subscriber]) -> None:
    server, events = served
    time.sleep(0.5)  # a ZMQ subscriber misses what is published before it joined
    first = prompt(1, PROMPT)
    server.generate(first, max_new_tokens=1)
    server.flush_cache()
    events.wait(lambda: events.hashes("BlockStored", "DISK"), "DISK event")
    device = events.hashes("BlockStored", "GPU")
    cpu = events.hashes("BlockStored", "CPU_PINNED")
    disk = events.hashes("BlockStored", "DISK")
    # every whole chunk of the prompt (its last token is never stored), page by page
    stored = (PROMPT - 1) // CHUNK * CHUNK // PAGE
    assert len(cpu) >= stored and cpu <= device, (len(cpu), stored, server.log()[-3000:])
    events.wait(lambda: len(events.hashes("BlockStored", "DISK")) >= stored, "all DISK events")
    assert events.hashes("BlockStored", "DISK") == cpu, (disk, cpu)
    events.wait(lambda: len(events.hashes("BlockStored", "EXTERNAL")) >= stored,
                "all EXTERNAL (Redis) events")
    assert events.hashes("BlockStored", "EXTERNAL") == cpu
    # more prompts than the CPU tier holds: the first prompt's chunks leave it, and say so
    for seed in range(2, 40):
        server.generate(prompt(seed, PROMPT), max_new_tokens=1)
        if events.hashes("BlockRemoved", "CPU_PINNED") & cpu:
            break
    events.wait(lambda: events.hashes("BlockRemoved", "CPU_PINNED") & cpu, "CPU eviction")
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_tier_events_false_leaves_sglang_s_device_events_alone(
        tiny_llama: Path, tmp_path: Path) -> None:
    """`tier_events: false`: the server publishes SGLang's device events as without kvtier,
    and nothing of kvtier's tiers (a router that should not see them: issue 70's baseline)."""
    server, events = _serve(tiny_llama, tmp_path, tier_events=False)
    try:
        time.sleep(0.5)  # a ZMQ subscriber misses what is published before it joined
        server.generate(prompt(1, PROMPT), max_new_tokens=1)
        server.flush_cache()  # waits for kvtier's stores: the CPU tier holds the prompt
        events.wait(lambda: events.hashes("BlockStored", "GPU"), "device event")
        disk = tmp_path / "disk"
        deadline = time.monotonic() + WAIT_S  # a bound on a hang
        while not any(p.is_file() for p in disk.rglob("*")):
            assert time.monotonic() < deadline, "nothing written to disk"
            time.sleep(0.1)
        server.generate(prompt(2, 2 * PAGE), max_new_tokens=1)  # one more publishing step
        events.wait(lambda: len(events.hashes("BlockStored", "GPU")) > (PROMPT - 1) // PAGE,
                    "the second prompt's device events")
        media = {e.medium for e in list(events.events) if hasattr(e, "medium")}
        assert media == {"GPU"}, media
    finally:
        events.close()
        server.kill()
