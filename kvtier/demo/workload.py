"""The demo's workload: conversations that share a long system prompt and grow turn by turn.

Prompts are token ids (exact lengths, no tokenizer round trip). Every conversation starts with
the same system prompt; each turn appends a user message to the conversation so far (which
already holds the previous turns' answers), so turn N's prompt extends turn N-1's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Workload", "Conversation"]

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


@dataclass
class Conversation:
    """One conversation's history as token ids (system prompt, then user/answer turns)."""

    index: int
    history: list[int] = field(default_factory=list)

    def next_prompt(self, workload: Workload, turn: int) -> list[int]:
        base = self.history or workload.system_prompt()
        return base + workload.user_message(self.index, turn)

    def answered(self, prompt: list[int], answer: list[int]) -> None:
        self.history = prompt + answer
