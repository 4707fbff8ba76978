"""The bridge between one SGLang scheduler (one TP rank) and a kvtier `CacheEngine`.

`SGLangKVTier` builds on the engine over SGLang's device KV pool and owns the background store
thread. It knows nothing about SGLang's radix tree: `radix_cache.KVTierRadixCache` decides what
to load and store and hands over token ids and pool slots.

Loads from disk or Redis never run on the scheduler thread: a request's prefetch moves them into
the CPU tier in the background while SGLang keeps the request waiting (per `prefetch_policy`).
What the CPU tier holds is reported to SGLang as a host hit, and copied into the pool only when
SGLang admits the request (`init_load_back`), at memory speed, once. What kvtier knows of a
request (its prefix and key chain, hashed once at its first match, its prefetch, its promise,
its verification cut) is one `request_state.RequestState`, kept in `requests` until it finishes
or goes away.

Stores run on one background thread (`stores.StoreWorker`); the slots a store reads stay pinned
by the caller's tree lock until the store has read them, never longer.

Every call on the scheduler thread is timed (`budget.SchedulerBudget`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import cast

import numpy as np
import torch

from kvtier import prometheus
from kvtier.config import Config
from kvtier.connectors import KVConnector, SGLangMHAConnector, SGLangMLAConnector
from kvtier.engine import CacheEngine, Prefix
from kvtier.engine.hints import Hints
from kvtier.engine.verify import agreed_sampling_key
from kvtier.errors import ConfigError
from kvtier.integration.sglang.admin.attach import Attachments
from kvtier.integration.sglang.blending.blender import BLEND_COUNTERS
from kvtier.integration.sglang.blending.engine_check import ENGINE_CHECK_COUNTERS
from kvtier.integration.sglang.boundary.sglang_views import MHAPoolView, MLAPoolView, Opaque
from kvtier.integration.sglang.launch.preflight import page_size_problem
from kvtier.integration.sglang.rank.budget import SchedulerBudget
from kvtier.integration.sglang.rank.request_state import RankRequests, VerifyCut
from kvtier.integration.sglang.rank.store_work import StoreWork
from kvtier.integration.sglang.rank.stores import StoreJob, StoreWorker
from kvtier.metrics import Counters

__all__ = ["SGLangKVTier", "StoreJob", "build_connector", "check_page_size"]

logger = logging.getLogger(__name__)

# The scheduler asks whether a new request may be admitted in the same step its prefetch
# started; a miss (nothing on disk or in Redis) resolves in about a millisecond, so waiting this
# long once saves a scheduler step (a forward pass); longer loads wait per `prefetch_policy`.
FIRST_CHECK_WAIT_S = 0.005

def check_page_size(config: Config, page_size: int) -> None:
    """`ConfigError` unless whole chunks are whole pages (so a load never splits a page)."""
    problem = page_size_problem(config, page_size)
    if problem is not None:
        raise ConfigError(problem)


def build_connector(pool: object) -> KVConnector:
    """The kvtier connector for an SGLang device KV pool; `ConfigError` for other pools."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if isinstance(pool, MLATokenToKVPool):
        return SGLangMLAConnector(cast(MLAPoolView, pool).kv_buffer)
    if isinstance(pool, MHATokenToKVPool):
        mha = cast(MHAPoolView, pool)
        return SGLangMHAConnector(mha.k_buffer, mha.v_buffer)
    raise ConfigError(f"kvtier supports SGLang's MHATokenToKVPool and MLATokenToKVPool; this "
                      f"model uses {type(pool).__name__}")


class SGLangKVTier:
    """A `CacheEngine` plus the store thread, for one SGLang TP rank.

    Args:
        engine: the kvtier engine over this rank's pool.
        page_size: SGLang's page size (loads and stores are whole pages).
        reduce_min: all-reduces a 1-element int64 tensor with MIN across the TP group, so that
            every rank loads as many tokens and verifies the same requests (a secret agreed
            here, so every rank constructs its adapter in step; ranks must agree on the tree).
        rank: this rank's place in the TP group (a blender's columns of the KV heads).
        stores: whether this rank stores (an MLA rank other than 0 keeps its CPU tier only:
            the engine decides what reaches the lower tiers).
    """

    def __init__(self, engine: CacheEngine, page_size: int,
                 reduce_min: Callable[[torch.Tensor], None] | None = None, *,
                 stores: bool = True, rank: int = 0):
        check_page_size(engine.config, page_size)
        self.engine = engine
        self.rank = rank
        self.stores_enabled = stores
        self.page_size = page_size
        self.chunk_size: int = engine.config.chunk_size
        self._reduce_min = reduce_min
        if reduce_min is not None:
            engine.sampling_key = agreed_sampling_key(self.agree_min)
        # Counted from the scheduler thread and the store thread: `Counters` is thread-safe.
        self.counters = Counters(*(f"sglang.{name}" for name in (
            "loads", "tokens_loaded", "load_misses", "load_no_slots", "loads_short",
            "loads_discarded", "stores", "tokens_stored", "stores_skipped_busy", "store_errors",
            "prefetches", "prefetches_cancelled", "prefetch_waits",
            "prefetches_skipped_hot", "verified_requests", "verified_tokens",
            *BLEND_COUNTERS, *ENGINE_CHECK_COUNTERS)))
        self.budget = SchedulerBudget(self.counters)
        self._work = StoreWork(engine, self.counters)  # what the store thread does
        # every request kvtier was asked about, alike on every rank (scheduler thread)
        self.requests = RankRequests()
        self._exported = _AdapterStats(self.counters)
        prometheus.register(self._exported)  # the engine's own stats are exported by storage
        self.stores = StoreWorker(self._work.run, self.counters)
        self.attachments = Attachments(engine)  # tiers attached over HTTP
        self._closed = False

    # ---- loads (scheduler thread) ----

    def loadable_end(self, num_tokens: int) -> int:
        """The most leading tokens of a `num_tokens` prefix a load could ever provide."""
        end = self.engine.keys.num_keyed_tokens(num_tokens)
        return end - end % self.page_size

    def prefix(self, rid: str | None, token_ids: np.ndarray, salt: str = "") -> Prefix:
        """`token_ids` with the request's `salt` (its `cache_salt`) as the engine's `Prefix`,
        its key chain hashed once per request `rid`: a later call about a prefix of the same
        tokens shares it (callers pass a `limit`)."""
        state = self.requests.open(rid) if rid is not None else None
        cached = state.prefix if state is not None else None
        if cached is not None and cached.salt == salt and cached.covers(token_ids):
            return cached.reuse(token_ids)
        prefix = self.engine.prefix(token_ids, salt)
        if state is not None:
            state.prefix = prefix
        return prefix

    def check_segments(self, check: Callable[[StoreJob], object]) -> None:
        """Blending: `check` sees every verified request's store job first, on the store
        thread, while its slots are still the request's (`StoreWork.segment_check`)."""
        self._work.segment_check = check

    def shadowed(self, rid: str, device_len: int) -> bool:
        """Whether request `rid` is verified in full (`verify_fraction`, `verify_scope: full`;
        every rank decides alike): it hits nothing, and its store first compares what it
        computed past `device_len` with the tiers' records (`CacheEngine.verify`)."""
        if self._closed or not self.engine.verifies(rid, "full"):
            return False
        self.requests.open(rid).verify = VerifyCut(device_len, False)
        return True

    def shadow_tail(self, rid: str, device_len: int, hit: int) -> int:
        """How much of its `hit` (tokens, from 0) request `rid` loads: all of it, or, when
        it is verified with `verify_scope: tail`, all but the hit's last full chunk, which it
        computes and its store compares with the tiers' records. With no full chunk past
        `device_len` in the hit, it loads nothing and is compared from `device_len` on."""
        if self._closed or hit <= device_len or not self.engine.verifies(rid, "tail"):
            return hit
        full_end = hit - hit % self.chunk_size  # chunks are whole pages: so is the cut
        cut = max(full_end - self.chunk_size, device_len)
        self.requests.open(rid).verify = VerifyCut(cut, cut > device_len)
        return cut

    def verifying(self, rid: str) -> bool:
        """Whether request `rid` is computed to verify the tiers (`shadowed`, `shadow_tail`)."""
        state = self.requests.get(rid)
        return state is not None and state.verify is not None

    def loaded(self, rid: str) -> None:
        """Request `rid`'s admission loaded what it will: its key chain is no longer needed
        (its store hashes what it stores)."""
        state = self.requests.get(rid)
        if state is not None:
            state.prefix = None

    def lookup(self, rid: str | None, token_ids: np.ndarray, salt: str = "", *,
               limit: int | None = None) -> int:
        """Leading tokens of `token_ids` (at most `limit`) every rank can load now, in whole
        pages (metadata only: what the CPU tier holds; lower tiers load in the background).
        Tokens past `limit` still name the chunks: a chunk the limit cuts loads in part."""
        hit = self.engine.lookup(self.prefix(rid, token_ids, salt), hot_only=True, limit=limit)
        return self.agree_min(hit - hit % self.page_size)

    def retrieve(self, rid: str | None, token_ids: np.ndarray, slots: torch.Tensor,
                 skip: int, salt: str = "", *, limit: int | None = None) -> int:
        """Scatter cached KV into `slots` past `skip` (at most `limit` tokens); returns the
        leading tokens now valid on every rank, in whole pages (at least `skip`)."""
        got = self.engine.retrieve(self.prefix(rid, token_ids, salt), slots, skip=skip,
                                   hot_only=True, limit=limit)
        got = max(self.agree_min(got - got % self.page_size), skip)
        if got > skip:
            if rid is not None:
                self.requests.open(rid).found = got
            self.counters.inc("sglang.loads")
            self.counters.inc("sglang.tokens_loaded", got - skip)
        else:
            self.counters.inc("sglang.load_misses")
        return got

    # ---- background loads (scheduler thread; every rank calls these in step) ----

    def start_prefetch(self, rid: str, token_ids: np.ndarray, salt: str = "") -> None:
        """Start loading `token_ids`' lower-tier chunks into the CPU tier for request `rid`."""
        state = self.requests.get(rid)
        if self._closed or (state is not None and state.prefetch is not None) \
                or self.engine.verifies(rid, "full"):
            return  # it loads nothing: it is computed, then compared
        end = self.loadable_end(len(token_ids))
        if end == 0:
            return
        # The request's match (just before) hashed its whole prompt: the chunk that holds the
        # last prompt token is loaded too, for all but that token.
        prefetch = self.engine.start_prefetch(self.prefix(rid, token_ids, salt), limit=end)
        # Registered on every rank, done or not: `prefetch_ready` agrees across ranks, so one
        # rank whose CPU tier held it all (a done handle, nothing to load) waits for the rest.
        self.requests.add_prefetch(rid, prefetch)
        self.counters.inc("sglang.prefetches" if prefetch.keys else "sglang.prefetches_skipped_hot")

    def prefetch_ready(self, rid: str) -> bool:
        """Whether request `rid` may be admitted now, per `prefetch_policy`, on every rank.

        Once ready, the prefetch is stopped (what arrived stays in the CPU tier, where the
        admission's load finds it) and forgotten.
        """
        state = self.requests.get(rid)
        prefetch = state.prefetch if state is not None else None
        if state is None or prefetch is None:
            return True
        if not state.checked:
            state.checked = True
            prefetch.wait_ready(FIRST_CHECK_WAIT_S)
        # One rank's load may finish later: admit only when every rank is ready.
        if not self.agree_min(int(prefetch.ready())):
            self.counters.inc("sglang.prefetch_waits")
            return False
        self.requests.end_prefetch(rid)
        prefetch.cancel()
        prometheus.observe_hit("gate", time.monotonic() - prefetch.started)
        return True

    def cancel_prefetch(self, rid: str) -> None:
        """Request `rid` went away: forget it, stop its load and drop the chunks only it
        brought in."""
        state = self.requests.forget(rid)
        prefetch = state.prefetch if state is not None else None
        if prefetch is None:
            return
        prefetch.cancel(drop=True)
        self.counters.inc("sglang.prefetches_cancelled")
        logger.info("kvtier: request %s left while its prefetch %s; cancelled", rid,
                    "was done" if prefetch.done() else "was running")

    def release_session(self, session_id: str) -> None:
        """SGLang closed the session: unpin its prefix (scheduler thread)."""
        closed = self._work.closed_sessions
        if len(closed) > 10_000:
            closed.clear()
        closed.add(session_id)
        self.engine.release_session(session_id)  # logs the release

    def observe_prefill(self, tokens: int, seconds: float, prompt_len: int) -> None:
        """SGLang computed `tokens` new tokens of prompts up to `prompt_len` long in `seconds`
        (one extend batch, scheduler thread): the recompute speed loads are weighed against."""
        self.engine.prefill.observe(tokens, seconds, prompt_len)

    def pending_prefetches(self) -> int:
        return self.requests.prefetching()

    def pending_stores(self) -> int:
        return self.stores.pending()

    def agree_min(self, value: int) -> int:
        """The minimum of `value` over the TP group (every rank must call this in step)."""
        if self._reduce_min is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._reduce_min(t)
        return int(t.item())

    # ---- stores ----

    def submit_store(self, token_ids: np.ndarray, slots: torch.Tensor, handle: Opaque,
                     session_id: str | None = None, salt: str = "",
                     prompt_len: int | None = None, rid: str | None = None,
                     hints: Hints | None = None) -> bool:
        """Queue a background store of `token_ids` from pool `slots` (scheduler thread);
        `prompt_len`: the request's prompt (the tail a repeat of it looks up is stored too);
        `rid`: the request, verified first if it was `shadowed`; `hints`: its lifecycle hints.

        Returns False (and stores nothing) when the queue is full or stores are off on this
        rank; the caller then releases `handle` itself. When True, `handle` comes back from
        `poll_done()` once the store no longer reads the slots.
        """
        if self._closed or not self.stores_enabled:
            return False
        ready = None
        if slots.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        # the request is done: its store is the last thing kvtier does for it
        state = self.requests.forget(rid) if rid is not None else None
        return self.stores.submit(StoreJob(
            token_ids, slots, handle, ready, session_id, salt=salt, prompt_len=prompt_len,
            verify=None if state is None else state.verify,
            known=0 if state is None else state.found, hints=hints))

    def poll_done(self) -> list[StoreJob]:
        """Stores whose slots are free, whose handles the caller may now release (scheduler
        thread); a store still queued at its deadline is cancelled and returned too."""
        return self.stores.collect()

    def settle(self) -> list[StoreJob]:
        """Wait (`blocking_timeout_secs` in all) until every submitted store has read its
        slots, cancelling those still queued after that; returns what is done, for the caller
        to release."""
        return self.stores.collect(wait=True, timeout=self.engine.config.blocking_timeout_secs)

    # ---- lifecycle ----

    def flush(self, timeout: float) -> None:
        """Let queued lower-tier writes land (bounded), e.g. before a device-cache flush."""
        self.engine.flush(timeout)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counters.snapshot(declared=True))
        out.update(self.engine.stats())
        return out

    def close(self) -> None:
        """Stop the store thread after the queued stores, then close the engine. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for prefetch in self.requests.take_prefetches():
            prefetch.cancel()
        self.attachments.close()
        self.stores.close(self.engine.config.blocking_timeout_secs)
        logger.info("kvtier: closing; %s", self.counters.snapshot())
        self.engine.close()


class _AdapterStats:
    """The adapter's own counters as a metrics source (`sglang.*` keys)."""

    def __init__(self, counters: Counters):
        self._counters = counters

    def stats(self) -> dict[str, float]:
        return dict(self._counters.snapshot(declared=True))

