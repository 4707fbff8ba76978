"""Shadow verification: a sampled request that would hit is computed as a miss instead, and the
KV it computed is compared with what each tier holds for the same chunks.

A checksum proves a record holds the bytes that were written; it cannot prove they are the KV
this model computes for these tokens. A model changed under the same identity, a writer that
swapped rows or slots, a dtype mix-up: all load as valid hits. This module checks meaning, at
the price of one prefill per verified request.

The comparison is per chunk and per layer: the relative L2 distance between the fresh KV and the
tier's, `||fresh - held|| / ||held||` over the layer's keys and values. Two honest computations
of the same prompt differ only by the rounding of different batch shapes, far below
`TOLERANCE` (docs/verification.md has the measurements); a chunk over it in any layer is a
mismatch: counted (`verify_mismatch` in the tier's scope), logged with the tier, the chunk and
the first layer that differs, and quarantined: the chunk and every later chunk of the request
are removed from that tier, so no request loads them (a chained key is never reached past a
missing one) and the store that follows writes the fresh KV in their place.

With `verify_scope: tail` the request loads its prefix and computes only the last full chunk of
its hit. A fresh chunk computed over a loaded prefix that no tier's record matches may owe the
difference to that prefix (a changed model differs everywhere), or to the records alone (one
forged record). Blame goes by source (`suspect`): only when a tier that supplied the prefix
holds one of the differing records does `purge` remove every chunk of the request from every
tier, storing nothing of it (the next request computes it); otherwise the quarantine of the
differing records stands, as in a full verification.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvtier.keys import ChunkKey, KeyChain
from kvtier.memory import MemoryObj, lease
from kvtier.metrics import RateLimitedLog
from kvtier.storage import StorageManager
from kvtier.storage.records import TierRecords

__all__ = ["TOLERANCE", "Verdict", "Verification", "shadow_check", "sampled", "sampling_key",
           "agreed_sampling_key", "layer_errors", "disowned", "suspect", "purge"]

logger = logging.getLogger(__name__)
_warn = RateLimitedLog(logger)

# The largest relative L2 distance per layer that still counts as the same KV, per pool dtype.
# Honest recomputations in other batches measured far below (docs/verification.md); a changed
# weight matrix, a swapped row or another dtype lands orders of magnitude above.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-3,
    torch.float16: 2e-2,
    torch.bfloat16: 5e-2,
}
_DEFAULT_TOLERANCE = 5e-2  # 8-bit pools and anything else: as loose as bf16


class Verdict(NamedTuple):
    """One chunk compared with one tier's record of it. `layer`: the first layer over the
    tolerance (None: the chunk matched); `error`: the relative distance there (or the worst of
    all layers on a match); `source`: the tier whose record it is: `tier`, except for the CPU
    tier's copy of a record it read from a lower tier (`StorageManager.origins`)."""

    tier: str
    chunk: int
    key: ChunkKey
    layer: int | None
    error: float
    source: str = ""

    @property
    def matched(self) -> bool:
        return self.layer is None


class Verification(NamedTuple):
    """What `CacheEngine.verify` did: tokens newly stored, a verdict per chunk and tier
    compared (none when no tier held a chunk of the verified span), and the records `purge`
    removed, over every tier (a tail verification whose loaded prefix is suspect)."""

    stored: int
    verdicts: list[Verdict]
    purged: int = 0

    @property
    def mismatches(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.matched]


SAMPLING_KEY_BYTES = 16


def sampling_key() -> bytes:
    """A new secret for `sampled`, from `os.urandom`."""
    return os.urandom(SAMPLING_KEY_BYTES)


def agreed_sampling_key(agree_min: Callable[[int], int]) -> bytes:
    """A secret for `sampled` that every TP rank gets alike: `agree_min` gives the minimum of
    an int over the ranks (a collective: every rank calls this in step), taken over random
    draws, so no rank, and nobody outside, chooses it."""
    return b"".join(agree_min(secrets.randbits(63)).to_bytes(8, "big")
                    for _ in range(SAMPLING_KEY_BYTES // 8))


def sampled(request_id: str, fraction: float, key: bytes) -> bool:
    """Whether request `request_id` is one of the `fraction` verified: a hash of the id keyed
    by `key`, a secret the server drew at start (`sampling_key`; TP ranks agree on one,
    `agreed_sampling_key`). Every call about the same request under the same key decides the
    same way; a client, which sets request ids, can neither predict nor choose which of its
    requests are verified. Each id is sampled with probability `fraction` over keys; 0 samples
    none and 1 every id.

    Raises:
        ValueError: `key` is shorter than `SAMPLING_KEY_BYTES` (an empty key is no secret).
    """
    if len(key) < SAMPLING_KEY_BYTES:
        raise ValueError(f"key: a sampling key has at least {SAMPLING_KEY_BYTES} bytes, "
                         f"got {len(key)}")
    if fraction <= 0.0:
        return False
    if fraction >= 1.0:
        return True
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "big") < fraction * 2.0 ** 64


def layer_errors(fresh: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The relative L2 distance per layer between two chunks (`[planes, layers, tokens,
    hidden]`), computed in float32: 0 where the layer's values are the same (NaN where NaN),
    infinite where a NaN or an infinity stands on one side only; a layer whose record is all
    zeros compares absolutely."""
    a, b = fresh.float(), held.float()
    same = ((a == b) | (a.isnan() & b.isnan())).transpose(0, 1).reshape(a.shape[1], -1).all(1)
    diff = (a - b).pow(2).sum(dim=(0, 2, 3)).sqrt()
    norm = b.pow(2).sum(dim=(0, 2, 3)).sqrt()
    errors = torch.nan_to_num(diff / norm.clamp_min(1e-12), nan=math.inf, posinf=math.inf)
    return torch.where(same, 0.0, errors)


def shadow_check(storage: StorageManager, keys: Sequence[ChunkKey], start: int,
                 gather: Callable[[Sequence[ChunkKey]], list[MemoryObj]]) -> list[Verdict]:
    """Compare the fresh KV of the chunks of `keys` (a request's full chunks; a `KeyChain`
    also names the tails a quarantine removes) that hold token `start` or later with every
    tier's records of them; quarantine and count what differs. `gather` copies the named chunks
    from the pool into new objects (fewer when memory runs out). Runs before the store of the
    same chunks, so that the store writes fresh KV where a record was removed."""
    # The chunk that holds `start` is compared whole: the request computed its later tokens,
    # and its earlier ones are the pool's own prefix (a device-held system prompt ends inside
    # a chunk on most requests; skipping that chunk would leave it never verified).
    first = next((i for i, k in enumerate(keys) if k.end > start), len(keys))
    span = list(keys[first:])
    held = [(tier, tier.held(span)) for tier in storage.tier_records()]
    held = [(tier, n) for tier, n in held if n]
    if not held:
        return []
    fresh = gather(span[:max(n for _, n in held)])
    verdicts: list[Verdict] = []
    with lease(fresh):
        for tier, n in held:
            with lease(tier.read(span[:min(n, len(fresh))])) as records:
                verdicts += _Tier(storage, tier, keys, first).compare(fresh, records)
    return verdicts


class _Tier:
    """One tier's side of a check: its counters, the comparison, the quarantine."""

    def __init__(self, storage: StorageManager, tier: TierRecords, keys: Sequence[ChunkKey],
                 first: int):
        self._tier = tier
        self._keys = keys  # the request's chunks; compared from `first` on
        self._first = first
        self._counters = storage.counters.scope(tier.name, "verify_checked", "verify_mismatch")
        self._source = _sources(storage) if tier.hot else lambda _: tier.name

    def compare(self, fresh: Sequence[MemoryObj], held: Sequence[MemoryObj]) -> list[Verdict]:
        """A verdict per chunk `held` (in order), up to the first mismatch (the chunks after
        it leave the tier with it)."""
        tier = self._tier
        tolerance = TOLERANCE.get(fresh[0].tensor.dtype, _DEFAULT_TOLERANCE) if fresh else 0.0
        verdicts = []
        for i, (new, old) in enumerate(zip(fresh, held)):
            errors = layer_errors(new.tensor, old.tensor)
            over = (errors > tolerance).nonzero()
            layer = int(over[0]) if over.numel() else None
            error = float(errors[layer] if layer is not None else errors.max())
            chunk = self._first + i
            key = self._keys[chunk]
            verdicts.append(Verdict(tier.name, chunk, key, layer, error, self._source(key)))
            self._counters.inc("verify_checked")
            if layer is not None:
                self._counters.inc("verify_mismatch")
                self._quarantine(chunk, layer, error, tolerance)
                break
        return verdicts

    def _quarantine(self, i: int, layer: int, error: float, tolerance: float) -> None:
        """Remove chunk `i`, the chunks after it and the tails that cover part of it."""
        tier, keys = self._tier, self._keys
        tails = keys.tails(i) if isinstance(keys, KeyChain) else []
        removed = tier.remove([*keys[i:], *tails])
        _warn.warning(f"verify-{tier.name}",
                      "kvtier: verification MISMATCH in tier %s: chunk %d (tokens %d-%d, key "
                      "%s...) differs from a fresh prefill from layer %d on (relative error "
                      "%.3g, tolerance %.3g); %d chunks from it on removed from %s, so no "
                      "request loads them. A model changed under the same identity, or a "
                      "writer bug: see docs/verification.md",
                      tier.name, i, keys[i].start, keys[i].end, keys[i].key[:16], layer, error,
                      tolerance, removed, tier.name)


def disowned(verdicts: Sequence[Verdict]) -> set[int]:
    """The chunks whose fresh KV differs from every tier's record of them: no tier vouches for
    what this server computed (one tier that matches puts the fault in the other's record)."""
    return {v.chunk for v in verdicts} - {v.chunk for v in verdicts if v.matched}


def suspect(storage: StorageManager, keys: Sequence[ChunkKey], start: int,
            verdicts: Sequence[Verdict]) -> bool:
    """For a verification whose tokens before `start` were loaded from the tiers (`verify_scope:
    tail`): whether the evidence points at that prefix, not only at records. It does when a
    tier that supplied a chunk of the prefix holds a record of a `disowned` chunk
    (`Verdict.source`): that tier's writer computed, over the same prefix, KV this server does
    not (a model changed under the same identity). A disowned chunk's records from tiers that
    supplied none of the prefix (a forged Redis record of the last chunk, over a prefix from
    the CPU tier or disk) blame those records alone."""
    orphans = disowned(verdicts)
    if not orphans:
        return False
    source = _sources(storage)
    suppliers = {source(k) for k in keys if k.end <= start}
    return any(v.chunk in orphans and v.source in suppliers for v in verdicts)


def _sources(storage: StorageManager) -> Callable[[ChunkKey], str]:
    """Which tier's record the CPU tier's copy of a chunk is (its own, unless it was read from a
    lower tier; what a request loaded came through the CPU tier)."""
    hot = storage.hot.name
    return lambda key: storage.origins.of(key, hot)


def purge(storage: StorageManager, keys: KeyChain) -> int:
    """Remove every full chunk of `keys` and the tails inside its first chunk from every tier
    (tails further on hang off removed chunks: no chained lookup reaches them); returns how
    many records went. For a tail verification whose loaded prefix is `suspect`: the fresh
    chunk was computed over a prefix the tiers supplied, and a tier that supplied it disagrees
    with this server about what follows (a model changed under the same identity differs in
    every chunk)."""
    doomed = [*keys, *keys.tails(0)]
    removed = sum(tier.remove(doomed) for tier in storage.tier_records())
    _warn.warning("verify-purge",
                  "kvtier: verification (scope tail): a chunk computed over a loaded prefix "
                  "matches no tier's record of it, and a tier that supplied the prefix holds "
                  "one of those records, so the prefix is suspect too: %d records of the "
                  "request's %d chunks removed from every tier and nothing stored; the next "
                  "request computes them", removed, len(keys))
    return removed
