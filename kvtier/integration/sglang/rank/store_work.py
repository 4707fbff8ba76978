"""What the store thread does for one finished request of an SGLang rank: the store, or, for a
request computed to verify the tiers, the comparison and then the store."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtier.engine import CacheEngine
from kvtier.integration.sglang.rank.stores import StoreJob
from kvtier.metrics import Counters

__all__ = ["StoreWork"]

logger = logging.getLogger(__name__)


class StoreWork:
    """`run(job)` stores a finished request (the store thread calls it, `stores.StoreWorker`).

    `closed_sessions`: sessions SGLang closed (the scheduler thread adds to it); a store
    finishing late must not pin their prefix again. `segment_check` (blending): called with a
    verified request's job before its comparison, while its slots are still the request's
    (`blending.engine_check`: its first segment's records against the pool's KV).
    """

    def __init__(self, engine: CacheEngine, counters: Counters):
        self.engine = engine
        self.counters = counters
        self.chunk_size: int = engine.config.chunk_size
        self.closed_sessions: set[str] = set()
        self.segment_check: Callable[[StoreJob], object] | None = None

    def run(self, job: StoreJob) -> int:
        """The store thread's work for one job."""
        sid = job.session_id if job.session_id not in self.closed_sessions else None
        # A repeat of the prompt loads all but its last token (a whole chunk it ends needs no tail)
        also = job.prompt_len - 1 if job.prompt_len and job.prompt_len % self.chunk_size else None
        # On a GPU the copy waits for `job.ready` on kvtier's stream, which releases the slots.
        if job.verify is not None:
            return self._verify(job, sid, also)
        stored = self.engine.store(job.token_ids, job.slots, session_id=sid,
                                   on_read=job.release_slots, salt=job.salt, also_prefix=also,
                                   ready=job.ready, known=job.known, hints=job.hints)
        self.counters.inc("sglang.stores")
        self.counters.inc("sglang.tokens_stored", stored)
        logger.debug("kvtier: stored %d new tokens of a %d-token prefix", stored,
                     len(job.token_ids))
        return int(stored)

    def _verify(self, job: StoreJob, sid: str | None, also: int | None) -> int:
        """The store of a verified request: the comparison, then the store itself."""
        assert job.verify is not None
        if self.segment_check is not None:
            try:
                self.segment_check(job)
            except Exception:  # a cache never takes serving down: the prefix check still runs
                self.counters.inc("sglang.store_errors")
                logger.exception("kvtier: checking a verified request's segment failed")
        result = self.engine.verify(job.token_ids, job.slots, start=job.verify.start,
                                    loaded=job.verify.loaded, session_id=sid,
                                    on_read=job.release_slots, salt=job.salt,
                                    also_prefix=also, ready=job.ready, hints=job.hints)
        chunks = len({v.chunk for v in result.verdicts})
        self.counters.inc("sglang.verified_requests")
        # What verification cost: the tokens a tier held, which a hit would have loaded.
        self.counters.inc("sglang.verified_tokens", chunks * self.chunk_size)
        self.counters.inc("sglang.stores")
        self.counters.inc("sglang.tokens_stored", result.stored)
        worst = max((v.error for v in result.verdicts), default=0.0)
        logger.info("kvtier: verified %d chunks of a %d-token prefix against %s: %d mismatched "
                    "(largest relative error %.3g)%s",
                    chunks, len(job.token_ids),
                    sorted({v.tier for v in result.verdicts}) or "no tier (nothing held)",
                    len(result.mismatches), worst,
                    f"; {result.purged} records of its loaded prefix removed"
                    if result.purged else "")
        return result.stored
