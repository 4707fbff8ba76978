"""How a batch of chunks is laid out over Redis: each chunk's Redis keys and payload size
(`plan`), a batch's indices grouped by the node that owns their keys (`by_node`, one round
trip per node), and an encrypted put's indices cut into groups of bounded ciphertext
(`put_groups`). Pure functions of their arguments; RedisBackend sends what they plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from kvtier.backends.redis import io as rio
from kvtier.backends.redis.router import Router
from kvtier.keys import ChunkKey
from kvtier.memory import KVLayout

__all__ = ["Plan", "by_node", "plan", "put_groups"]

Plan = list[tuple[list[str], int]]  # per chunk: its Redis keys and its payload size


def plan(keys: Sequence[ChunkKey], layout: KVLayout, seg: int) -> Plan:
    """Each of `keys`' Redis keys (its record in segments of `seg` bytes) and payload size."""
    out = []
    for k in keys:
        nbytes = layout.nbytes(k.num_tokens)
        # len(rio.segments(nbytes, seg)), without building them: tails come in hundreds
        out.append((rio.redis_keys(k, max(1, -(-nbytes // seg))), nbytes))
    return out


def by_node(router: Router, rkeys: list[list[str]]) -> list[tuple[redis.Redis, list[int]]]:
    """Indices of `rkeys` grouped by the node that owns them, in order within a node."""
    groups: dict[int, tuple[redis.Redis, list[int]]] = {}
    for i, names in enumerate(rkeys):
        client = router.node_for(names[0])
        groups.setdefault(id(client), (client, []))[1].append(i)
    return list(groups.values())


def put_groups(idxs: list[int], plan: Plan, limit: int | None) -> list[list[int]]:
    """`idxs` in one group per round trip: all of them for plain records (`limit` None: sent
    from the arena), else groups of at most `limit` payload bytes (at least one record each),
    so the ciphertext buffers of a long prefix never add up to its size."""
    if limit is None:
        return [idxs]
    groups: list[list[int]] = [[]]
    held = 0
    for i in idxs:
        if groups[-1] and held + plan[i][1] > limit:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += plan[i][1]
    return groups
