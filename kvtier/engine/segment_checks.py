"""Shadow verification of segment records: each tier's record of a segment compared with the
segment's standalone KV computed again now.

A segment record holds the KV of the segment's tokens computed alone, as a whole prompt at
position 0 (`SegmentStore.save`), and a blend reads it wherever the segment stands. A checksum
cannot tell a forged record (a plain Redis anyone on its network writes to) or a wrong one from
the KV the model computes for those tokens, so a sampled request's segments are computed alone
again and every tier's records of them compared with that fresh KV: like with like, position 0
on both sides, per layer by the relative L2 distance and tolerance of prefix verification
(`kvtier.engine.verify.layer_errors`, `TOLERANCE`). A record over it is counted
(`verify_mismatch` in the tier's scope, beside the prefix records'), logged, and removed from
that tier with the segment's records after it, so no blend reads it again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtier.engine.verify import TOLERANCE, Verdict, layer_errors
from kvtier.keys import ChunkKey, KeyChain
from kvtier.memory import lease
from kvtier.metrics import RateLimitedLog
from kvtier.storage import StorageManager
from kvtier.storage.records import TierRecords

__all__ = ["check_segment"]

logger = logging.getLogger(__name__)
_warn = RateLimitedLog(logger)


def check_segment(storage: StorageManager, chain: KeyChain, fresh: torch.Tensor) -> list[Verdict]:
    """Compare every tier's records of the segment `chain` names with `fresh`, the segment's
    KV computed alone now (`[2, layers, tokens, kv_width]`, its token i at `[:, :, i]`, any
    device); remove from a tier what differs there.

    Per tier: its leading full chunks up to the first that differs, then every tail it holds
    after the last full chunk (a load reads the longest some tier holds; each is compared, so
    none can stand in when a longer one goes). A chunk that differs leaves the tier with every
    later chunk and the tails inside it (a chained lookup never reaches past it); a tail that
    differs leaves alone. A tier that holds nothing of the segment is not compared.
    Reads every tier (disk, Redis): never on the scheduler thread.

    Returns:
        A verdict per record compared, in tier order (`Verdict.chunk`: the chunk's index, or
        `len(chain)` for a tail).
    """
    fresh = fresh.detach().to("cpu")
    verdicts: list[Verdict] = []
    for tier in storage.tier_records():
        verdicts += _Records(storage, tier, chain, fresh).check()
    return verdicts


class _Records:
    """One tier's records of one segment: the comparison, the counters, the removal."""

    def __init__(self, storage: StorageManager, tier: TierRecords, chain: KeyChain,
                 fresh: torch.Tensor):
        self._tier = tier
        self._chain = chain
        self._fresh = fresh
        self._tolerance = TOLERANCE.get(fresh.dtype, TOLERANCE[torch.bfloat16])
        self._counters = storage.counters.scope(tier.name, "verify_checked", "verify_mismatch")

    def check(self) -> list[Verdict]:
        tier, chain = self._tier, self._chain
        verdicts: list[Verdict] = []
        held = tier.held(chain)
        if held:
            with lease(tier.read(chain[:held])) as records:
                for i, record in enumerate(records):
                    verdicts.append(self._compare(i, chain[i], record.tensor))
                    if not verdicts[-1].matched:
                        self._remove(verdicts[-1], [*chain[i:], *chain.tails(i)])
                        break
        # Compared even after a chunk left: a faster tier's chunks lead a load to this tail.
        tails = chain.tails(len(chain))
        while tails and (at := tier.first_held(tails)) >= 0:
            tail, tails = tails[at], tails[at + 1:]
            with lease(tier.read([tail])) as records:
                if records:  # gone since, or corrupt (then a miss to a load as well)
                    verdicts.append(self._compare(len(chain), tail, records[0].tensor))
                    if not verdicts[-1].matched:
                        self._remove(verdicts[-1], [tail])
        return verdicts

    def _compare(self, i: int, key: ChunkKey, record: torch.Tensor) -> Verdict:
        errors = layer_errors(self._fresh[:, :, key.start:key.end], record)
        over = (errors > self._tolerance).nonzero()
        layer = int(over[0]) if over.numel() else None
        error = float(errors[layer] if layer is not None else errors.max())
        self._counters.inc("verify_checked")
        if layer is not None:
            self._counters.inc("verify_mismatch")
        return Verdict(self._tier.name, i, key, layer, error)

    def _remove(self, verdict: Verdict, doomed: Sequence[ChunkKey]) -> None:
        tier, key = self._tier, verdict.key
        removed = tier.remove(doomed)
        _warn.warning(f"verify-segment-{tier.name}",
                      "kvtier: verification MISMATCH in tier %s: a segment's record of its "
                      "tokens %d-%d (key %s...) differs from the segment computed alone now "
                      "from layer %s on (relative error %.3g, tolerance %.3g); %d records of "
                      "it removed from %s, so no blend reads them. A forged or corrupt record, "
                      "or a changed model: see docs/verification.md", tier.name, key.start,
                      key.end, key.key[:16], verdict.layer, verdict.error, self._tolerance,
                      removed, tier.name)
