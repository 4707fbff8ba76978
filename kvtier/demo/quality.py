"""What a hit must not change: the answer a server gives from loaded KV against the answer a
server without kvtier computes from scratch (the quality tests and `bench_quality.py`).

An `Answer` is one greedy generation with SGLang's log-probabilities (`return_logprob`): the
output tokens, each one's log-probability, and the first token's top-20 distribution.
`compare` gives an `Agreement`: the same tokens, the largest log-probability difference over
the first `LOGPROB_TOKENS`, the KL divergence of the first token's top-20 distributions, and
the mean of that KL over the first `LOGPROB_TOKENS` positions both answers reached by the same
tokens (the quality gate of a lossy record codec, docs/codecs.md).

The bounds: greedy outputs identical; |delta logprob| <= `LOGPROB_TOLERANCE`; KL <= `KL_LIMIT`
(the bound SGLang's own HiCache tests use). In float32 on CPU two honest computations of the
same prompt differed by at most 1.1e-5 (a CPU-tier hit of 2400 tokens against its miss, TP 1
and TP 2): the tolerance leaves two orders of magnitude for batch-shape numerics, and a wrong
chunk (another prompt's KV, a shifted layer) moves log-probabilities by whole units.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.demo import texts

__all__ = ["Answer", "Agreement", "compare", "ask", "documents", "LOGPROB_TOKENS",
           "LOGPROB_TOLERANCE", "KL_LIMIT", "TOP_K", "top_kl"]

LOGPROB_TOKENS = 16
LOGPROB_TOLERANCE = 1e-3
KL_LIMIT = 0.005
TOP_K = 20


class Poster(Protocol):
    def post(self, path: str, body: dict[str, Any] | None = None,
             timeout: float = 300) -> Any: ...


@dataclass(frozen=True)
class Answer:
    """One greedy generation: its text and tokens, each token's log-probability, the first
    token's top-`TOP_K` (token id -> log-probability), and what the prompt hit."""

    text: str
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    first_top: dict[int, float]
    prompt_tokens: int
    cached_tokens: int
    tops: tuple[dict[int, float], ...] = ()  # every output token's top-`TOP_K`

    @classmethod
    def from_response(cls, response: dict[str, Any]) -> Answer:
        meta = response["meta_info"]
        tokens = meta["output_token_logprobs"]  # [logprob, token id, text] per output token
        tops = tuple({int(t[1]): float(t[0]) for t in top or []}
                     for top in meta["output_top_logprobs"] or [])
        return cls(response["text"], tuple(int(t[1]) for t in tokens),
                   tuple(float(t[0]) for t in tokens), tops[0] if tops else {},
                   int(meta["prompt_tokens"]), int(meta.get("cached_tokens", 0)), tops)


@dataclass(frozen=True)
class Agreement:
    """How far `got` is from `reference`; `ok` applies the module's bounds."""

    identical: bool
    max_delta: float  # largest |delta logprob| over the first LOGPROB_TOKENS output tokens
    kl: float  # KL(reference || got) of the first token, over the top-K ids both list
    shared_top: int  # how many of the reference's top-K ids `got` lists too
    mean_kl: float = 0.0  # `kl` averaged over the first LOGPROB_TOKENS positions reached alike

    @property
    def ok(self) -> bool:
        return (self.identical and self.max_delta <= LOGPROB_TOLERANCE
                and self.kl <= KL_LIMIT and self.shared_top >= TOP_K - 2)


def compare(reference: Answer, got: Answer) -> Agreement:
    """`got` against `reference`. The top-K lists are compared over the ids both hold,
    each renormalized: two honest computations may swap the K-th and the (K+1)-th."""
    n = min(len(reference.logprobs), len(got.logprobs), LOGPROB_TOKENS)
    deltas = [abs(a - b) for a, b in zip(reference.logprobs[:n], got.logprobs[:n],
                                         strict=True)]
    shared = [i for i in reference.first_top if i in got.first_top]
    same = 0  # positions whose preceding tokens agree: their distributions are comparable
    while same < min(n, len(reference.tops), len(got.tops)) and (
            same == 0 or reference.ids[same - 1] == got.ids[same - 1]):
        same += 1
    kls = [top_kl(reference.tops[i], got.tops[i]) for i in range(same)]
    return Agreement(reference.ids == got.ids, max(deltas, default=0.0),
                     top_kl(reference.first_top, got.first_top), len(shared),
                     sum(kls) / len(kls) if kls else 0.0)


def top_kl(reference: dict[int, float], got: dict[int, float]) -> float:
    """KL(reference || got) of two top-K lists (token id -> log-probability), over the ids
    both hold, each renormalized; inf when they share none."""
    shared = [i for i in reference if i in got]
    return _kl([reference[i] for i in shared], [got[i] for i in shared])


def _kl(p_logs: list[float], q_logs: list[float]) -> float:
    if not p_logs:
        return math.inf
    p_norm, q_norm = _logsumexp(p_logs), _logsumexp(q_logs)
    return max(0.0, sum(math.exp(p - p_norm) * ((p - p_norm) - (q - q_norm))
                        for p, q in zip(p_logs, q_logs, strict=True)))


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def ask(server: Poster, text: str, max_new_tokens: int = LOGPROB_TOKENS) -> Answer:
    """A greedy generation of `text` with the log-probabilities `compare` reads."""
    return Answer.from_response(server.post("/generate", {
        "text": text, "return_logprob": True, "top_logprobs_num": TOP_K,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
    }))


def documents(count: int, facts: int = 40, seed: int = 0) -> list[str]:
    """`count` prompts of real text a model can answer: an inventory of `facts` lines (about
    16 tokens each) and a question about one of them."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        lines = texts.facts(rng, facts)
        body = "\n".join(texts.record(i + 1, fact) for i, fact in enumerate(lines))
        prompts.append(f"Inventory of the company's depots.\n{body}\n\n"
                       f"Question: {texts.question(rng.choice(lines))}\nAnswer:")
    return prompts
