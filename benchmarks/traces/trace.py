"""A request trace in Mooncake's format (FAST'25, `kvcache-ai/Mooncake`, FAST25-release/traces):
one JSON object a line with `input_length` and `hash_ids`, the prompt as a chain of 512-token
blocks. Two requests that share their first k ids share their first k * 512 tokens, so an id
names its whole prefix (a block has one parent wherever it appears); the last block may be
partial."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

BLOCK = 512  # tokens a hash id stands for

__all__ = ["BLOCK", "Request", "hit_tokens", "input_tokens", "load"]


class Request(NamedTuple):
    input_length: int
    blocks: tuple[int, ...]


def load(path: Path, limit: int | None = None) -> list[Request]:
    """The first `limit` requests of the trace at `path` (all without a limit), in file order.
    `ValueError` names the line of a request whose chain cannot hold its input, or whose id
    has two parents (the hit rate's prefix reading would not hold)."""
    out: list[Request] = []
    parents: dict[int, int | None] = {}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            raw = json.loads(line)
            req = Request(int(raw["input_length"]), tuple(int(b) for b in raw["hash_ids"]))
            if not (len(req.blocks) - 1) * BLOCK < req.input_length <= len(req.blocks) * BLOCK:
                raise ValueError(f"{path}:{line_no}: {len(req.blocks)} blocks cannot hold "
                                 f"input_length {req.input_length}")
            for i, block in enumerate(req.blocks):
                parent = req.blocks[i - 1] if i else None
                if parents.setdefault(block, parent) != parent:
                    raise ValueError(f"{path}:{line_no}: block {block} follows "
                                     f"{parents[block]} elsewhere, {parent} here")
            out.append(req)
    return out


def hit_tokens(req: Request, blocks: int) -> int:
    """Tokens a hit on the request's first `blocks` blocks saves (the last block may be
    partial)."""
    return min(blocks * BLOCK, req.input_length)


def input_tokens(requests: list[Request]) -> int:
    return sum(r.input_length for r in requests)
