"""The demo's workload: conversations that share a long system prompt and grow turn by turn.

Prompts are token ids of exact lengths. Every conversation starts with the same system prompt;
each turn appends a user message to the conversation so far (which already holds the previous
turns' answers), so turn N's prompt extends turn N-1's. The ids are random for a generated
model (`Workload` itself) or real text for a real one (`TextPrompts`: an inventory as the
system prompt, a question about it as each user message).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.demo import texts

__all__ = ["Workload", "Conversation", "Prompts", "TextPrompts"]

FIRST_ID = 4  # ids 0-3 are the special tokens


@dataclass(frozen=True)
class Workload:
    """Sizes of the demo's conversations; `vocab` bounds the token ids used."""

    conversations: int = 3
    turns: int = 4
    system_prompt_tokens: int = 4096
    user_tokens: int = 96
    answer_tokens: int = 16
    vocab: int = 400
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompt_tokens", "user_tokens",
                     "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.vocab <= FIRST_ID:
            raise ValueError(f"vocab must be > {FIRST_ID}, got {self.vocab}")

    def max_prompt_tokens(self) -> int:
        """The longest prompt (the last turn's), plus the tokens generated for it."""
        return self.system_prompt_tokens + self.turns * (self.user_tokens + self.answer_tokens)

    def system_prompt(self) -> list[int]:
        return self._ids(("system",), self.system_prompt_tokens)

    def user_message(self, conversation: int, turn: int) -> list[int]:
        return self._ids(("user", conversation, turn), self.user_tokens)

    def _ids(self, tag: tuple[object, ...], n: int) -> list[int]:
        rng = random.Random(repr((self.seed, *tag)))
        return [rng.randrange(FIRST_ID, self.vocab) for _ in range(n)]


class Prompts(Protocol):
    """Where a conversation's token ids come from."""

    def system_prompt(self) -> list[int]: ...

    def user_message(self, conversation: int, turn: int) -> list[int]: ...


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class TextPrompts:
    """The workload's sizes filled with real text: the system prompt an inventory of records,
    each user message a question about one of them (earlier records filling it to its size),
    both cut to exactly the workload's token counts."""

    PREAMBLE = ("You are the inventory assistant of a logistics company. Answer each question "
                "from the records below with the number of crates only.\n")

    def __init__(self, workload: Workload, tokenizer: Tokenizer):
        self.workload, self.tokenizer = workload, tokenizer
        rng = random.Random(repr((workload.seed, "inventory")))
        # ~16 tokens a record; enough that the cut always falls inside the records
        self.facts = texts.facts(rng, workload.system_prompt_tokens // 8 + 8)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def system_prompt(self) -> list[int]:
        body = "\n".join(texts.record(i + 1, f) for i, f in enumerate(self.facts))
        ids = self._ids(self.PREAMBLE + body)
        return ids[:self.workload.system_prompt_tokens]

    def user_message(self, conversation: int, turn: int) -> list[int]:
        rng = random.Random(repr((self.workload.seed, "user", conversation, turn)))
        asked = self._ids(f"\nQuestion: {texts.question(rng.choice(self.facts))}\nAnswer:")
        room = max(0, self.workload.user_tokens - len(asked))
        filler = self._ids("\nAlso recorded today: " + " ".join(
            texts.sentence(f) for f in texts.facts(rng, room // 8 + 2)))
        return filler[:room] + asked[-self.workload.user_tokens:]


@dataclass
class Conversation:
    """One conversation's history as token ids (system prompt, then user/answer turns)."""

    index: int
    history: list[int] = field(default_factory=list)

    def next_prompt(self, prompts: Prompts, turn: int) -> list[int]:
        base = self.history or prompts.system_prompt()
        return base + prompts.user_message(self.index, turn)

    def answered(self, prompt: list[int], answer: list[int]) -> None:
        self.history = prompt + answer
