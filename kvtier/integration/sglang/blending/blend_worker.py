"""Segments computed alone, on one background thread: to store them, and to verify their records.

A segment a request missed is computed alone (position 0) once the request has finished and
stored in every tier, for the next prompt that holds it (`warm`). A request that verification
sampled (`verify_fraction`) has its segments' records checked (`verify`): each segment some tier
holds is computed alone again with the served model's weights and compared with every tier's
records of it (`kvtier.engine.segment_checks`); a record that differs leaves the tier that
holds it, and the fresh KV is stored in its place. Both read disk and Redis and compute a
prefill: never on SGLang's scheduler thread. On a CPU engine they wait for quiet moments
between batches.

Where SGLang's model can run on this thread (`rows_forward`: tensor parallel 1, SGLang's CPU
engine), it computes the segments: every record, and every check of one, is SGLang's own KV of
the segment, so a fault in kvtier's second implementation of the model (`blend.forward`) can
neither write a record nor vouch for one. Elsewhere kvtier's forward computes them, and only
the segment that starts a prompt meets SGLang's KV (`engine_check`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvtier.background import ENGINE, HOLD_S, lower_priority, name_os_thread
from kvtier.blend.forward import LlamaWeights, prefill
from kvtier.blend.segments import Segment, find_segments
from kvtier.engine.segments import SegmentStore
from kvtier.integration.sglang.blending.rows_forward import RowsForward
from kvtier.keys import KeyChain
from kvtier.metrics import Counters

__all__ = ["WORKER_COUNTERS", "WORKER_QUEUE", "SegmentWorker"]

logger = logging.getLogger(__name__)

WORKER_COUNTERS = ("blend_segments_stored", "blend_segments_dropped",
                   "blend_segments_verified", "blend_segments_mismatched")
WORKER_QUEUE = 64  # jobs waiting for the thread; more are dropped (counted)


class _Job(NamedTuple):
    ids: np.ndarray  # a segment's tokens (warm), or a whole prompt but its last token (verify)
    salt: str
    verify: bool


class SegmentWorker:
    """The background thread of one blender (started at construction; `close` stops it).

    Args:
        weights: the served model's tensors (the prefill of a segment alone).
        store: the segment store.
        separator: `blend_special_str` as token ids; `min_tokens`, `max_segments`: which of a
            prompt's segments are verified (those a blend would read).
        counters: where `WORKER_COUNTERS` and `blend_failures` are counted (`sglang.` names).
        cols: on a tensor-parallel rank, its columns of the KV `weights` compute (what its
            records hold).
        engine: SGLang's model on this thread (`RowsForward.alone`), which then computes the
            segments instead of kvtier's forward over `weights`.
    """

    def __init__(self, weights: LlamaWeights, store: SegmentStore, separator: Sequence[int],
                 min_tokens: int, max_segments: int, counters: Counters,
                 cols: slice | None = None, engine: RowsForward | None = None):
        self.w = weights
        self._engine = engine
        self._cols = cols  # a tensor-parallel rank's columns of the whole model's KV
        self.store = store
        self._separator = tuple(separator)
        self._min_tokens = min_tokens
        self._max_segments = max_segments
        self.counters = counters
        self._queue: queue.Queue[_Job | None] = queue.Queue(WORKER_QUEUE)
        self._warming: set[tuple[int, ...]] = set()
        self._thread = threading.Thread(target=self._loop, name="kvtier-segments", daemon=True)
        self._thread.start()

    def warm(self, tokens: np.ndarray, segments: Sequence[Segment], salt: str) -> None:
        """Queue `segments` of `tokens` for a standalone prefill and a store (any thread)."""
        for seg in segments:
            ids = np.array(tokens[seg.start:seg.end], dtype=np.int64)
            marker = _marker(ids, salt)
            if marker in self._warming:
                continue
            if self._put(_Job(ids, salt, verify=False)):
                self._warming.add(marker)

    def verify(self, tokens: np.ndarray, salt: str) -> None:
        """Queue the records of prompt `tokens`' segments (all but its last token, at most
        `max_segments`) for verification against the segments computed alone (any thread)."""
        self._put(_Job(np.array(tokens[:len(tokens) - 1], dtype=np.int64), salt, verify=True))

    def drain(self, timeout: float) -> bool:
        """Wait until every queued job is done; False if `timeout` ran out first."""
        done = self._queue.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._queue.unfinished_tasks, timeout)

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # a daemon thread: it stops with the process

    def _put(self, job: _Job) -> bool:
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            self.counters.inc("sglang.blend_segments_dropped")
            return False

    def _loop(self) -> None:
        lower_priority()
        name_os_thread()
        while (job := self._queue.get()) is not None:
            try:
                if job.verify:
                    self._verify_prompt(job.ids, job.salt)
                else:
                    self._warm_one(job.ids, job.salt)
            except Exception as exc:  # a cache never takes serving down
                self.counters.inc("sglang.blend_failures")
                logger.warning("kvtier: computing a %d-token %s alone failed: %s", len(job.ids),
                               "prompt's segments" if job.verify else "segment", exc)
            finally:
                if not job.verify:
                    self._warming.discard(_marker(job.ids, job.salt))
                self._queue.task_done()

    def _warm_one(self, ids: np.ndarray, salt: str) -> None:
        chain = self.store.chain(ids, Segment(0, len(ids)), salt)
        if self.store.lookup(chain, hot_only=True) >= len(ids):
            return  # another request's copy got there first
        if self.store.save(chain, self._prefill(ids)):
            self.counters.inc("sglang.blend_segments_stored")

    def _verify_prompt(self, ids: np.ndarray, salt: str) -> None:
        segments = find_segments(ids, self._separator, self._min_tokens)[:self._max_segments]
        for seg in segments:
            chain = self.store.chain(ids, seg, salt)
            if self.store.lookup(chain):  # some tier holds it: a blend could read it
                self._verify_one(chain, ids[seg.start:seg.end])

    def _verify_one(self, chain: KeyChain, ids: np.ndarray) -> None:
        kv = self._prefill(ids)
        verdicts = self.store.verify(chain, kv)
        self.counters.inc("sglang.blend_segments_verified")
        if all(v.matched for v in verdicts):
            return
        self.counters.inc("sglang.blend_segments_mismatched")
        self.store.save(chain, kv)  # the fresh KV where a record was removed
        logger.info("kvtier: verified a %d-token segment: %d of %d records differed from it "
                    "computed alone (tiers %s) and were removed", len(ids),
                    sum(not v.matched for v in verdicts), len(verdicts),
                    sorted({v.tier for v in verdicts if not v.matched}))

    @torch.inference_mode()
    def _prefill(self, ids: np.ndarray) -> torch.Tensor:
        """The segment's KV computed alone, at position 0 (as a record holds it): by SGLang's
        model where it runs here, else (or should it ever fail, from then on) kvtier's."""
        if ENGINE.enabled:
            ENGINE.wait_quiet(HOLD_S)  # on a CPU engine, compute between batches
        if self._engine is not None:
            try:
                return self._engine.alone(torch.from_numpy(ids))
            except Exception:
                self._engine = None
                logger.exception("kvtier: SGLang's model did not compute a segment alone; "
                                 "kvtier's forward computes segments from now on")
        dev = self.w.embed.device
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            kv = prefill(self.w, torch.from_numpy(ids).to(dev), logits=False).kv
        return kv if self._cols is None else kv[..., self._cols].contiguous()


def _marker(ids: np.ndarray, salt: str) -> tuple[int, ...]:
    """A segment's identity in the queue (dedup only: a collision skips one warm-up)."""
    return (hash(salt), hash(ids.tobytes()), len(ids))
