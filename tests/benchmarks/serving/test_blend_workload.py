"""bench_blend's workload and answer measures: every question has its answer in exactly one
document of its prompt, answers are compared as sentences, and the server KL stops where two
answers part."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.serving import blend_workload
from benchmarks.serving.blend_sglang import answer_kl
from kvtier.demo.quality import Answer


class Words:
    """A tokenizer of whole words: enough to build and read prompts in a test."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split(" ")]

    def decode(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)


def test_each_depot_has_its_own_place_and_manager_and_enough_tokens() -> None:
    tok = Words()
    pool = blend_workload.depots(tok, 12, 120, random.Random(3))
    assert len({d.place for d in pool}) == len({d.manager for d in pool}) == 12
    for d in pool:
        text = tok.decode(d.ids)
        assert len(d.ids) >= 120
        assert f"The manager of the depot in {d.place} is {d.manager}." in text
        assert not any(o.manager in text for o in pool if o is not d)
    with pytest.raises(ValueError, match="pool must be in 1..16, got 17"):
        blend_workload.depots(tok, 17, 120, random.Random(3))


def test_a_question_names_a_depot_whose_manager_one_document_of_the_prompt_names() -> None:
    tok = Words()
    rng = random.Random(5)
    pool = blend_workload.depots(tok, 8, 60, rng)
    sep = tok.encode("<sep>")
    orders = set()
    for ids, asked in blend_workload.queries(tok, pool, sep, 6, 4, rng):
        text = tok.decode(ids)
        docs = text.split(" <sep> ")[1:-1]  # the system line, then 4 documents
        assert len(docs) == 4 and sum(asked.manager in d for d in docs) == 1
        assert text.count(f"depot in {asked.place}?") == 1
        orders.add(tuple(d[:60] for d in docs))
    assert len(orders) == 6  # drawn and shuffled per query
    with pytest.raises(ValueError, match="docs must be in 1..8"):
        blend_workload.queries(tok, pool, sep, 1, 9, rng)


def test_an_answer_is_the_first_sentence_of_a_reply() -> None:
    answer = blend_workload.answer
    assert answer("The manager is Ana Silva. The manager of") == "The manager is Ana Silva"
    assert answer("Ana Silva<|im_end|>\n<|im_end|>") == "Ana Silva"
    assert answer("Ana Silva\nBoris") == answer("Ana Silva")


def _answer(ids: tuple[int, ...]) -> Answer:
    return Answer("", ids, tuple(0.0 for _ in ids), {}, 10, 0)


def _tops(*firsts: float) -> list[list[list[float | int]]]:
    """Per position, a top-2 list: token 1 at log-probability `p`, token 2 at log(1 - e^p)."""
    return [[[p, 1, ""], [math.log1p(-math.exp(p)), 2, ""]] for p in firsts]


def test_the_answer_kl_averages_positions_up_to_where_two_answers_part() -> None:
    full, same = _tops(-0.1, -0.1, -0.1), _tops(-0.1, -0.1, -3.0)
    kl = answer_kl(_answer((1, 1, 1)), _answer((1, 1, 1)), full, same, 3)
    assert kl == pytest.approx(answer_kl(_answer((1,)), _answer((1,)), full[2:], same[2:], 1)
                               / 3)
    assert kl > 0
    # they part at the second token: the third position is not compared
    parted = answer_kl(_answer((1, 1, 1)), _answer((1, 2, 1)), full, same, 3)
    assert parted == 0.0
    assert answer_kl(_answer((1, 1, 1)), _answer((1, 1, 1)), full, same, 2) == 0.0
