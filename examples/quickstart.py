"""Store a prompt's KV from one paged pool and load it into another, through kvtier's tiers.

Run: .venv/bin/python examples/quickstart.py [config.yaml]
The pools here are plain tensors shaped like SGLang's MHATokenToKVPool buffers.
"""

from __future__ import annotations

import sys

import torch

from kvtier import CacheEngine, KVLayout, load_config
from kvtier.connectors import SGLangMHAConnector
from kvtier.storage import StorageManager

LAYERS, HEADS, HEAD_DIM, SLOTS = 4, 2, 64, 4096


def make_pool(fill: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    def layer() -> torch.Tensor:
        shape = (SLOTS, HEADS, HEAD_DIM)
        return torch.randn(shape).bfloat16() if fill else torch.zeros(shape, dtype=torch.bfloat16)

    return [layer() for _ in range(LAYERS)], [layer() for _ in range(LAYERS)]


def main() -> None:
    config = load_config(sys.argv[1] if len(sys.argv) > 1 else None)
    layout = KVLayout.mha(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                          dtype=torch.bfloat16)
    k, v = make_pool(fill=True)  # server A computed this prompt's KV
    k2, v2 = make_pool(fill=False)  # server B has an empty pool
    prompt = torch.randint(0, 32_000, (3 * config.chunk_size + 10,))
    slots_a = torch.randperm(SLOTS)[: prompt.numel()]
    slots_b = torch.randperm(SLOTS)[: prompt.numel()]

    # One process plays both servers, so they share one set of tiers (two servers share
    # them through disk or Redis instead).
    tiers = StorageManager(config, layout)
    a = CacheEngine(config, model_name="demo", layout=layout,
                    connector=SGLangMHAConnector(k, v), storage=tiers)
    b = CacheEngine(config, model_name="demo", layout=layout,
                    connector=SGLangMHAConnector(k2, v2), storage=tiers)
    print("stored tokens:", a.store(prompt, slots_a))
    print("lookup:", b.lookup(prompt))
    loaded = b.retrieve(prompt, slots_b)
    print("loaded tokens:", loaded)
    same = all(torch.equal(x[slots_a[:loaded]], y[slots_b[:loaded]])
               for x, y in zip(k + v, k2 + v2))
    print("byte-exact:", same)
    a.close()
    b.close()
    tiers.close()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
