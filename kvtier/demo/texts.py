"""Real text for the real model: inventories of a logistics company and questions about them.

Deterministic for a seed, so two runs (and a test and a benchmark) send the same prompts. The
model (SmolLM2-135M-Instruct) answers such questions with a number or a place, which makes a
wrong answer after a hit easy to see.
"""

from __future__ import annotations

import random
from typing import NamedTuple

__all__ = ["Fact", "GOODS", "PLACES", "facts", "question", "record", "sentence"]

PLACES = ("Lyon", "Osaka", "Quito", "Tromso", "Perth", "Accra", "Lima", "Graz", "Hanoi",
         "Leeds", "Turku", "Cusco", "Dakar", "Split", "Bergen", "Nantes")
GOODS = ("apples", "copper wire", "wool blankets", "glass jars", "rice", "bicycle tyres",
         "olive oil", "paper", "candles", "salt", "batteries", "coffee beans")


class Fact(NamedTuple):
    place: str
    goods: str
    crates: int


def facts(rng: random.Random, count: int) -> list[Fact]:
    return [Fact(rng.choice(PLACES), rng.choice(GOODS), rng.randint(10, 990))
            for _ in range(count)]


def sentence(fact: Fact) -> str:
    return f"The depot in {fact.place} holds {fact.crates} crates of {fact.goods}."


def record(index: int, fact: Fact) -> str:
    """One inventory line, about 16 tokens."""
    return f"Record {index}: {sentence(fact)}"


def question(fact: Fact) -> str:
    return f"How many crates of {fact.goods} does the depot in {fact.place} hold?"
