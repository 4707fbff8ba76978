from __future__ import annotations

import pytest
import torch

from kvtier.blend.forward import LayerWeights, LlamaWeights
from kvtier.blend.rope import RotaryTable


def tiny_llama(seed: int = 0, layers: int = 4, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, inter: int = 96, vocab: int = 101,
               dtype: torch.dtype = torch.float32) -> LlamaWeights:
    """A random Llama small enough to run anywhere in milliseconds."""
    g = torch.Generator().manual_seed(seed)
    d = hidden // heads

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / cols**0.5).to(dtype)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)

    stack = tuple(LayerWeights(norm(), mat((heads + 2 * kv_heads) * d, hidden),
                               mat(hidden, heads * d), norm(), mat(2 * inter, hidden),
                               mat(hidden, inter)) for _ in range(layers))
    embed = (torch.randn(vocab, hidden, generator=g)).to(dtype)
    return LlamaWeights(embed, stack, norm(), mat(vocab, hidden), heads, kv_heads, d, 1e-5,
                        RotaryTable.from_theta(d, 10000.0, 4096))


@pytest.fixture
def llama() -> LlamaWeights:
    return tiny_llama()
