"""The long-document QA benchmark's workload (`bench_longdoc.py`): documents of random token
ids, the questions asked about them, and the orders of the query round.

Every document set (one per query order, one per all-miss pair) has its own ids, so no two
documents share more than a chance first token, and every question is new: what a query can
reuse is its document.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.anchors.servers import random_ids

__all__ = ["ORDERS", "Documents", "query_order"]

ORDERS = ("tile", "interleave", "random")


@dataclass(frozen=True)
class Documents:
    """The documents and questions; token ids are deterministic per seed and set name."""

    documents: int = 4
    document_len: int = 2048
    question_len: int = 32
    output_len: int = 8
    repeats: int = 3
    miss_documents: int = 4
    miss_pairs: int = 4
    seed: int = 0

    def document(self, doc_set: str, i: int) -> list[int]:
        return random_ids(("longdoc", self.seed, doc_set, i), self.document_len)

    def question(self, doc_set: str, i: int, k: object) -> list[int]:
        return random_ids(("question", self.seed, doc_set, i, k), self.question_len)

    def longest(self) -> int:
        return self.document_len + self.question_len + self.output_len

    def working_set(self) -> int:
        """One order's documents, each with a question and an answer."""
        return self.documents * self.longest()

    def warmup(self, order: str) -> list[list[int]]:
        return [self.document(order, i) + self.question(order, i, "warm-up")
                for i in range(self.documents)]

    def queries(self, order: str) -> list[list[int]]:
        """The query round: the k-th question to document i, in `order`'s sequence."""
        asked: dict[int, int] = {}
        prompts = []
        for i in query_order(order, self.documents, self.repeats, self.seed):
            k = asked[i] = asked.get(i, -1) + 1
            prompts.append(self.document(order, i) + self.question(order, i, k))
        return prompts

    def misses(self, pair: int) -> list[list[int]]:
        """The documents of all-miss pair `pair` (both of its blocks send them, each once, to
        their own server); no other pair or order uses them."""
        return [self.document(f"miss-{pair}", i) + self.question(f"miss-{pair}", i, 0)
                for i in range(self.miss_documents)]


def query_order(order: str, documents: int, repeats: int, seed: int = 0) -> list[int]:
    """Document indices of the query round: `tile` [0..N-1] * repeats; `interleave` each
    document `repeats` times in a row; `random` the tile's multiset shuffled (seeded)."""
    tile = [i for _ in range(repeats) for i in range(documents)]
    if order == "tile":
        return tile
    if order == "interleave":
        return [i for i in range(documents) for _ in range(repeats)]
    if order == "random":
        random.Random(repr(("order", seed))).shuffle(tile)
        return tile
    raise ValueError(f"unknown order {order!r}; choose from {ORDERS}")
