"""Lifecycle hints (`kvtier.engine.hints`, issue 69 item 3): an agent's prefix retained across
a pause survives traffic that evicts everything else, an ephemeral span is never stored, and a
bad hint is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine
from kvtier.engine.hints import MAX_RETAIN_S, Hints

CHUNK, LAYERS, HEADS, DIM = 16, 2, 2, 8  # a chunk: 4 KiB
TIER_CHUNKS = 32
PROMPT_CHUNKS = 4
SLOTS = PROMPT_CHUNKS * CHUNK


def _engine() -> CacheEngine:
    gen = torch.Generator().manual_seed(0)
    bufs = [torch.randn(SLOTS, HEADS, DIM, generator=gen) for _ in range(2 * LAYERS)]
    connector = SGLangMHAConnector(bufs[:LAYERS], bufs[LAYERS:])
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=TIER_CHUNKS * 4096 / 1e9,
                 save_tails=False, admission_policy="always")
    return CacheEngine(cfg, model_name="m", layout=connector.layout, connector=connector)


def _tokens(seed: int, n: int = SLOTS) -> torch.Tensor:
    return torch.randint(0, 30_000, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("retain", [True, False])
def test_an_agents_prefix_retained_across_a_tool_call_survives_other_traffic(
        retain: bool) -> None:
    """An agent stores its prefix, pauses (a tool call) while other requests store three times
    the CPU tier, then comes back: retained, its whole prefix is a hit; not, it is gone."""
    slots = torch.arange(SLOTS)
    agent = _tokens(1)
    with _engine() as eng:
        hints = Hints(retain_s=30.0) if retain else None
        assert eng.store(agent, slots, hints=hints) == SLOTS
        for seed in range(100, 100 + 3 * TIER_CHUNKS // PROMPT_CHUNKS):
            assert eng.store(_tokens(seed), slots) == SLOTS
        held = eng.lookup(agent, hot_only=True)
        stats = eng.stats()
        if retain:
            assert held == SLOTS
            assert stats["retained_prefixes"] == 1
        else:
            assert held == 0
            assert stats["retained_prefixes"] == 0


def test_retaining_the_same_prefix_again_renews_one_pin() -> None:
    slots = torch.arange(SLOTS)
    with _engine() as eng:
        for _ in range(3):
            eng.store(_tokens(1), slots, hints=Hints(retain_s=30.0))
        assert eng.stats()["retained_prefixes"] == 1
        eng.store(_tokens(2), slots, hints=Hints(retain_s=30.0))
        assert eng.stats()["retained_prefixes"] == 2


def test_an_ephemeral_span_and_what_follows_it_are_never_stored() -> None:
    slots = torch.arange(SLOTS)
    prompt = _tokens(3)
    with _engine() as eng:
        # Tokens 40 on (the middle of chunk 2) are ephemeral: chunks 0 and 1 are stored.
        assert eng.store(prompt, slots, hints=Hints(ephemeral_from=40)) == 2 * CHUNK
        assert eng.lookup(prompt) == 2 * CHUNK
        assert eng.store(prompt, slots, hints=Hints(ephemeral_from=0)) == 0
        assert eng.store(prompt, slots, hints=Hints(ephemeral_from=10 * SLOTS)) == 2 * CHUNK
        assert eng.lookup(prompt) == SLOTS  # past the prompt's end: all of it stored


@pytest.mark.parametrize(("hints", "name"), [
    (Hints(retain_s=0), "retain_s"), (Hints(retain_s=-1.0), "retain_s"),
    (Hints(retain_s=MAX_RETAIN_S * 2), "retain_s"), (Hints(retain_s=True), "retain_s"),
    (Hints(retain_s="30"), "retain_s"),  # type: ignore[arg-type]
    (Hints(ephemeral_from=-1), "ephemeral_from"), (Hints(ephemeral_from=1.5), "ephemeral_from"),
])
def test_a_bad_hint_is_refused_before_anything_is_stored(hints: Hints, name: str) -> None:
    prompt = _tokens(4)
    with _engine() as eng:
        with pytest.raises(ValueError, match=name):
            eng.store(prompt, torch.arange(SLOTS), hints=hints)
        assert eng.lookup(prompt) == 0


@pytest.mark.parametrize("how", ["retain", "session"])
def test_a_prefix_declared_to_come_back_is_stored_past_admission(how: str) -> None:
    """Admission refuses first-seen prompts while the tier is full (it guesses reuse from the
    past); a retained prefix or a session's turn declares its reuse, so it is stored and
    pinned however full the tier is."""
    slots = torch.arange(SLOTS)
    gen = torch.Generator().manual_seed(0)
    bufs = [torch.randn(SLOTS, HEADS, DIM, generator=gen) for _ in range(2 * LAYERS)]
    connector = SGLangMHAConnector(bufs[:LAYERS], bufs[LAYERS:])
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=TIER_CHUNKS * 4096 / 1e9,
                 save_tails=False, admission_policy="second_hit")
    with CacheEngine(cfg, model_name="m", layout=connector.layout, connector=connector) as eng:
        for seed in range(100, 100 + TIER_CHUNKS // PROMPT_CHUNKS):  # the tier is full
            assert eng.store(_tokens(seed), slots) == SLOTS
        assert eng.store(_tokens(7), slots) == 0  # first seen, would evict: refused
        agent = _tokens(1)
        if how == "retain":
            assert eng.store(agent, slots, hints=Hints(retain_s=30.0)) == SLOTS
        else:
            assert eng.store(agent, slots, session_id="s") == SLOTS
        for seed in range(200, 200 + 3 * TIER_CHUNKS // PROMPT_CHUNKS):
            eng.store(_tokens(seed), slots)  # refused or stored: never evicts the agent's
        assert eng.lookup(agent, hot_only=True) == SLOTS
