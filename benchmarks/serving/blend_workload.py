"""bench_blend's retrieval workload: depot documents and a question one of them answers.

The pool holds `pool` documents, one per depot (a place no other document names), each run by
a manager of its own. A document opens with who manages the depot, then lists its stock, every
line naming the depot and its manager again, until it holds about `doc_tokens` tokens. A
query is a system line, `docs` documents drawn from the pool in a shuffled order (each ended by
the separator), then "Who is the manager of the depot in X?" about one of them.

Why this question: the answer is in exactly one document, and SmolLM2-135M answers it from
the documents about half the time at 6 documents (11 of 20 prompts), so a blend that changes
the answer is visible. The earlier workload asked for a crate count that two or three records
often named with different counts, and the full prefill's first digit was wrong in each of the
7 of 10 answers that reached it: agreement there compared guesses.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from kvtier.demo import texts

__all__ = ["ASK", "Depot", "MANAGERS", "SYSTEM", "answer", "depots", "queries"]

SYSTEM = ("<|im_start|>system\nAnswer from the depot records.<|im_end|>\n"
          "<|im_start|>user\n")
ASK = "<|im_end|>\n<|im_start|>assistant\n"
MANAGERS = ("Ana Silva", "Boris Petrov", "Chen Wei", "Dara Okafor", "Elena Rossi",
            "Farid Haddad", "Greta Lund", "Hugo Martin", "Ines Costa", "Jonas Berg",
            "Kenji Sato", "Lena Novak", "Mateo Ruiz", "Nora Quinn", "Omar Aziz", "Priya Rao")


class Depot(NamedTuple):
    place: str
    manager: str
    ids: list[int]  # the document's tokens


def _text(place: str, manager: str, tokens: int, count: Callable[[str], int],
          rng: random.Random) -> str:
    lines = [f"This is the record of the depot in {place}. The manager of the depot in "
             f"{place} is {manager}."]
    while count(" ".join(lines)) < tokens:
        goods = rng.choice(texts.GOODS)
        lines.append(f"The depot in {place}, managed by {manager}, holds "
                     f"{rng.randint(10, 990)} crates of {goods}.")
    return " ".join(lines)


def depots(tok: Any, pool: int, doc_tokens: int, rng: random.Random) -> list[Depot]:
    """`pool` documents of at least `doc_tokens` tokens, each about a depot of its own.

    Raises:
        ValueError: `pool` larger than the places or managers there are.
    """
    places = texts.PLACES
    if not 0 < pool <= min(len(places), len(MANAGERS)):
        raise ValueError(f"pool must be in 1..{min(len(places), len(MANAGERS))}, got {pool}")

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    out = []
    for place, manager in zip(rng.sample(places, pool), rng.sample(MANAGERS, pool)):
        text = _text(place, manager, doc_tokens, count, rng)
        out.append(Depot(place, manager, tok.encode(text, add_special_tokens=False)))
    return out


def queries(tok: Any, pool: list[Depot], sep: list[int], n: int, docs: int,
            rng: random.Random) -> list[tuple[list[int], Depot]]:
    """`n` prompts (token ids) and the depot each asks about."""
    if not 0 < docs <= len(pool):
        raise ValueError(f"docs must be in 1..{len(pool)} (the pool), got {docs}")
    system, ask = (tok.encode(x, add_special_tokens=False) for x in (SYSTEM, ASK))
    out = []
    for _ in range(n):
        picked = rng.sample(pool, docs)
        asked = rng.choice(picked)
        ids = system + sep  # the system line ends with a separator too: no document joins it
        for d in picked:
            ids += d.ids + sep
        question = f"Who is the manager of the depot in {asked.place}?"
        out.append((ids + tok.encode(question, add_special_tokens=False) + ask, asked))
    return out


def answer(reply: str) -> str:
    """The answer in a reply: its first sentence. What the model says after it (the offline
    engine does not stop at the end of the turn) is not part of the answer."""
    return re.split(r"[.\n]|<\|im_end\|>", reply, maxsplit=1)[0].strip()
